"""WeightWatcher: STABLE-only discovery, per-mode ordering of cancel/pause/update/resume/flush, interval."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import GroupTable
from prime_async.simulation import SimParams, SimulatedEngine, run_virtual
from prime_async.weights.broadcasts import BroadcastDir
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.watcher import WeightWatcher
from prime_async.weights.watcher_peers import WatcherSettings


class FakeGroups:
    """Hand-written fake of the group table's drain side: records cancels; `wait_idle` returns once the
    test marks it idle."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.idle = asyncio.Event()
        self.idle.set()
        self.num_inflight_groups = 0

    def cancel_unshippable(self) -> list[int]:
        self.log.append(("cancel",))
        return []

    async def wait_idle(self) -> None:
        await self.idle.wait()
        self.log.append(("idle",))


class Broadcasts:
    def __init__(self, latest=None) -> None:
        self.latest = latest

    def latest_stable(self):
        return self.latest

    def path(self, version: int) -> str:
        return f"/b/step_{version}"


def make(mode: str, *, interval: int = 1, num_engines: int = 2, broadcasts=None):
    log: list = []
    engines = [SimulatedEngine(index=i, params=SimParams(), rng=random.Random(i)) for i in range(num_engines)]
    table = GroupTable(group_size=1, batch_groups=4, max_off_policy_steps=8, data=DataSource(num_examples=1),
                       retry_unused=False, max_dropped_groups_per_step=1)  # fmt: skip
    admission = AdmissionController(groups=table, max_inflight_groups=4, max_buffered_groups=4,
                                    granularity="group")  # fmt: skip
    dispatcher = FakeGroups(log)
    watcher = WeightWatcher(
        engines=engines, loader=FilesystemLoader(broadcasts or Broadcasts()), admission=admission,
        groups=dispatcher,
        settings=WatcherSettings(mode, interval, 0.5),
    )  # fmt: skip
    return watcher, engines, admission, dispatcher, log


def test_broadcast_dir_uses_only_stable(tmp_path: Path):
    b = BroadcastDir(tmp_path / "broadcasts")
    assert b.latest_stable() is None
    (tmp_path / "broadcasts" / "step_1").mkdir(parents=True)
    (tmp_path / "broadcasts" / ".step_2.tmp").mkdir()
    assert b.latest_stable() is None
    (tmp_path / "broadcasts" / "step_1" / "STABLE").touch()
    (tmp_path / "broadcasts" / "step_2").mkdir()
    assert b.latest_stable() == 1
    (tmp_path / "broadcasts" / "step_2" / "STABLE").touch()
    assert b.latest_stable() == 2 and b.path(2) == str(tmp_path / "broadcasts" / "step_2")


def test_retract_order_on_every_engine():
    async def go():
        watcher, engines, admission, _, log = make("retract")
        pause = engines[0].pause_generation

        async def logged_pause(mode):  # puts the first pause into the dispatcher's log: cancel comes first
            log.append(("pause",))
            await pause(mode)

        engines[0].pause_generation = logged_pause
        await watcher.update(3)
        for e in engines:
            assert e.calls == [("pause", "retract"), ("update", ("/b/step_3", 3, True)), ("continue", None)]
        assert log == [("cancel",), ("pause",)] and admission.served_version == 3

    run_virtual(go())


def test_served_version_changes_only_after_every_engine_loaded():
    async def go():
        watcher, engines, admission, _, _ = make("retract", num_engines=3)
        seen = []
        original = engines[2].update_weights_from_disk

        async def slow_update(*a, **kw):
            await asyncio.sleep(5)
            seen.append(admission.served_version)
            await original(*a, **kw)

        engines[2].update_weights_from_disk = slow_update
        await watcher.update(1)
        assert seen == [0] and admission.served_version == 1

    run_virtual(go())


def test_in_place_updates_without_flush_then_flushes_when_idle():
    async def go():
        watcher, engines, admission, dispatcher, _log = make("in_place")
        dispatcher.idle.clear()
        task = asyncio.create_task(watcher.update(2))
        await asyncio.sleep(1.0)
        assert admission.served_version == 2
        assert admission.poll() == "hold"  # no new request may reuse old-version prefix KV
        for e in engines:
            assert e.calls == [("pause", "in_place"), ("update", ("/b/step_2", 2, False)), ("continue", None)]
        dispatcher.idle.set()
        await task
        for e in engines:
            assert e.calls[-1] == ("flush", 0)
        assert admission.poll() is None and _log[-1] == ("idle",)

    run_virtual(go())


def test_sim_engine_refuses_flush_with_in_place_paused_requests():
    async def go():
        engine = SimulatedEngine(index=0, params=SimParams(latency_s=10), rng=random.Random(0))
        gen = asyncio.create_task(engine.generate([1, 2], {"max_new_tokens": 4}))
        await asyncio.sleep(0.1)
        await engine.pause_generation("in_place")
        with pytest.raises(RuntimeError, match="flush_cache"):
            await engine.update_weights_from_disk("/x", 1, flush_cache=True)
        await engine.continue_generation()
        await gen

    run_virtual(go())


def test_drain_waits_for_idle_before_update_and_never_pauses():
    async def go():
        watcher, engines, admission, dispatcher, log = make("drain")
        dispatcher.idle.clear()
        task = asyncio.create_task(watcher.update(1))
        await asyncio.sleep(3.0)
        assert admission.poll() == "hold" and all(e.calls == [] for e in engines)
        dispatcher.idle.set()
        await task
        for e in engines:
            assert e.calls == [("update", ("/b/step_1", 1, True))]
        assert log == [("cancel",), ("idle",)] and admission.poll() is None

    run_virtual(go())


def test_interval_and_run_loop_pick_latest(tmp_path: Path):
    async def go():
        root = tmp_path / "broadcasts"
        watcher, _engines, admission, _, _ = make("retract", interval=2, broadcasts=BroadcastDir(root))
        task = asyncio.create_task(watcher.run())
        (root / "step_1").mkdir(parents=True)
        (root / "step_1" / "STABLE").touch()
        await asyncio.sleep(2.0)
        assert admission.served_version == 0  # 1 < 0 + interval
        (root / "step_2").mkdir()
        await asyncio.sleep(2.0)
        assert admission.served_version == 0  # step_2 has no STABLE yet
        (root / "step_2" / "STABLE").touch()
        watcher.wake()
        await asyncio.sleep(0.5)
        assert admission.served_version == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(go())


class ForgetfulLoader:
    """Hand-written `WeightLoader` whose trainer holds only the newest `held` versions of `announced`."""

    def __init__(self, announced: int, held: int) -> None:
        self.announced, self.held = announced, held
        self.loads: list[int] = []

    def latest(self) -> int:
        return self.announced

    async def load(self, engines, version: int, *, flush_cache: bool) -> None:
        from prime_async.weights.loaders.base import VersionGone

        if version <= self.announced - self.held:
            raise VersionGone(f"cannot send version {version}: versions held: [{self.announced - 1}, ...]")
        self.loads.append(version)

    def on_published(self, msg) -> None:
        pass

    def engines_restarted(self) -> bool:
        return True


def test_a_version_gone_from_the_trainer_is_replaced_by_the_newest():
    """Distributed weights: the trainer keeps the two newest snapshots; a watcher that asks for an older
    one (it was held back) loads the newest in the same pause instead of failing the run."""

    async def go():
        watcher, engines, admission, _, _ = make("retract")
        watcher.loader = ForgetfulLoader(announced=5, held=2)
        await watcher.update(2)
        assert watcher.loader.loads == [5] and admission.served_version == 5
        assert not any(e.paused for e in engines), "the engines were resumed"

    run_virtual(go())


def test_deterministic_runs_never_skip_a_version_that_is_gone():
    from prime_async.weights.loaders.base import VersionGone

    async def go():
        watcher, _, _, _, _ = make("drain")
        watcher.loader = ForgetfulLoader(announced=5, held=2)
        watcher.schedule = object()  # deterministic: every version in turn, so a gap is an error
        with pytest.raises(VersionGone):
            await watcher.update(2)

    run_virtual(go())


def test_an_engine_dying_during_the_drain_stops_the_update_before_the_load():
    """Regression (feature matrix: inference kill x drain x distributed weights): the engine died while
    the update drained; the update went on to form the weight process group with it, and the trainer's control
    thread sat in that rendezvous for weights.timeout_s (600 s), deaf to the rejoin after recovery."""
    from prime_async.engine_api import EngineUnavailable

    async def go():
        watcher, _engines, admission, groups, _log = make("drain")
        loader = ForgetfulLoader(announced=1, held=2)
        watcher.loader = loader
        groups.idle.clear()  # episodes in flight: the update waits for them
        update = asyncio.create_task(watcher.update(1))
        await asyncio.sleep(1)
        watcher.engine_failed(EngineUnavailable("connection refused"))  # the gateway saw the engine die
        groups.idle.set()  # its episodes ended as errors
        with pytest.raises(EngineUnavailable, match="went down before weights v1 could load"):
            await update
        assert loader.loads == [] and admission.served_version == 0

    run_virtual(go())
