"""The weight watcher's engine-outage path, on fake engines (fast, deterministic; real asyncio).

The real-process version (SIGKILL of the inference server in a running `rl`) is test_faults.py; here the
protocol itself: a transport error during an update or reported by the gateway holds admission at once,
/health is polled with exponential backoff, and when the engine answers again admission is released and
the newest broadcast is loaded (served_version follows), with the outage counted in the metrics.
"""

from __future__ import annotations

import asyncio

import pytest

from prime_async.engine_api import EngineUnavailable
from prime_async.weights import engine_outage
from prime_async.weights import watcher as ww
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.watcher_peers import WatcherSettings


class FakeEngine:
    base_url = "http://fake"

    def __init__(self) -> None:
        self.up = False
        self.calls: list[str] = []
        self.health_checks = 0

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if not self.up:
            raise EngineUnavailable("All connection attempts failed")

    async def health(self) -> bool:
        self.health_checks += 1
        return self.up

    async def pause_generation(self, mode: str) -> None:
        self._check(f"pause:{mode}")

    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool) -> None:
        self._check(f"update:{version}")

    async def continue_generation(self) -> None:
        self._check("continue")

    async def flush_cache(self) -> None:
        self._check("flush")


class FakeAdmission:
    def __init__(self) -> None:
        self.served_version = 0
        self.holds = 0

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        assert self.holds > 0
        self.holds -= 1

    def set_served_version(self, version: int) -> None:
        self.served_version = version


class FakeDispatcher:
    num_inflight_groups = 0

    def cancel_unshippable(self) -> list[int]:
        return []

    async def wait_idle(self) -> None:
        return None


class Broadcasts:
    def __init__(self, latest: int | None) -> None:
        self.latest = latest

    def latest_stable(self) -> int | None:
        return self.latest

    def path(self, version: int) -> str:
        return f"/broadcasts/step_{version}"


def _watcher(engine: FakeEngine, admission: FakeAdmission, latest: int | None, mode: str) -> ww.WeightWatcher:
    return ww.WeightWatcher(
        engines=[engine], loader=FilesystemLoader(Broadcasts(latest)), admission=admission,
        groups=FakeDispatcher(),
        settings=WatcherSettings(mode, 1, 0.01),
    )  # type: ignore[arg-type]  # fmt: skip


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("mode", ["retract", "in_place", "drain"])
def test_update_during_outage_holds_dispatch_then_recovers(mode: str, monkeypatch) -> None:
    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(engine_outage, "BACKOFF_MAX_S", 0.04)
    engine, admission = FakeEngine(), FakeAdmission()
    watcher = _watcher(engine, admission, latest=1, mode=mode)

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        await _until(lambda: engine.health_checks >= 3)  # the update failed, /health is being polled
        assert admission.holds == 1 and admission.served_version == 0  # dispatch held, nothing loaded
        engine.up = True  # the launcher brought the engine back
        await _until(lambda: admission.served_version == 1)
        await _until(lambda: admission.holds == 0)
        task.cancel()

    asyncio.run(main())
    assert "update:1" in engine.calls
    m = watcher.metrics()
    assert m["engine/outages"] == 1 and m["engine/health_retries"] >= 2 and m["engine/down_time"] > 0


def test_gateway_report_holds_dispatch_until_health(monkeypatch) -> None:
    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.01)
    engine, admission = FakeEngine(), FakeAdmission()
    engine.up = True
    watcher = _watcher(engine, admission, latest=None, mode="retract")

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        engine.up = False
        watcher.engine_failed(EngineUnavailable("connection reset"))  # what the gateway calls
        watcher.engine_failed(EngineUnavailable("refused"))  # a second episode failing: one outage
        assert admission.holds == 1  # synchronous: no group is dispatched after the report
        await _until(lambda: engine.health_checks >= 2)
        assert admission.holds == 1
        engine.up = True
        await _until(lambda: admission.holds == 0)
        task.cancel()

    asyncio.run(main())
    assert watcher.metrics()["engine/outages"] == 1


class BusyGroups(FakeDispatcher):
    """Groups in flight whose next model calls an outage holds at the gateway: idle only once released."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()

    async def wait_idle(self) -> None:
        await self.finished.wait()


def test_outage_during_a_drain_recovers_before_the_held_groups_finish(monkeypatch) -> None:
    """A drain update waits for groups whose calls the outage holds at the request gate: the watcher must
    give up the drain, recover (the gate reopens, the calls go on) and load the version afterwards."""
    from prime_async.weights.request_gate import RequestGate

    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(engine_outage, "BACKOFF_MAX_S", 0.04)
    engine, admission, groups, gate = FakeEngine(), FakeAdmission(), BusyGroups(), RequestGate()
    engine.up = True
    watcher = ww.WeightWatcher(
        engines=[engine], loader=FilesystemLoader(Broadcasts(1)), admission=admission, groups=groups,
        settings=WatcherSettings("drain", 1, 0.01), request_gate=gate,
    )  # type: ignore[arg-type]  # fmt: skip

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        await _until(lambda: admission.holds == 1)  # the drain for v1 waits for the groups
        engine.up = False
        gate.engine_failed(EngineUnavailable("connection reset"))  # a group's call met the dead engine
        await _until(lambda: engine.health_checks >= 2)
        engine.up = True
        await _until(lambda: gate.engines_up, timeout_s=5.0)  # recovered while the drain was pending
        groups.finished.set()  # the held calls went on and the groups ended
        await _until(lambda: admission.served_version == 1)
        await _until(lambda: admission.holds == 0)
        task.cancel()

    asyncio.run(main())
