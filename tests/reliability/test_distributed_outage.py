"""Engine outage with `weights.transport = "distributed"`: after `/health` answers again the weight process
group is rebuilt and the newest version is sent to every engine even when it is the served one (a
restarted engine came back with an older version from disk and must rejoin). Fake engines, real asyncio, the
real `WeightWatcher`; the loader is a recording fake of `DistributedLoader`'s interface."""

from __future__ import annotations

import asyncio

import pytest
from test_engine_outage import FakeAdmission, FakeDispatcher, FakeEngine, _until

from prime_async.engine_api import EngineUnavailable
from prime_async.weights import engine_outage
from prime_async.weights import watcher as ww
from prime_async.weights.watcher_peers import WatcherSettings


class RecordingLoader:
    def __init__(self, latest: int) -> None:
        self._latest = latest
        self.calls: list[tuple[str, int]] = []

    def latest(self) -> int | None:
        return self._latest

    async def load(self, engines, version: int, *, flush_cache: bool) -> None:
        for engine in engines:
            engine._check(f"distributed:{version}")
        self.calls.append(("load", version))

    def on_published(self, msg) -> None:
        pass

    def engines_restarted(self) -> bool:
        self.calls.append(("rejoin", -1))
        return True


@pytest.mark.parametrize("mode", ["retract", "in_place", "drain"])
def test_outage_rejoins_and_resends_the_served_version(mode: str, monkeypatch) -> None:
    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(engine_outage, "BACKOFF_MAX_S", 0.04)
    engine, admission, loader = FakeEngine(), FakeAdmission(), RecordingLoader(latest=2)
    engine.up = True
    watcher = ww.WeightWatcher(
        engines=[engine], admission=admission, groups=FakeDispatcher(),
        settings=WatcherSettings(mode, 1, 60.0), loader=loader,
    )  # type: ignore[arg-type]  # fmt: skip

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        await _until(lambda: admission.served_version == 2)  # v2 loaded over the group
        assert loader.calls == [("load", 2)]
        engine.up = False
        watcher.engine_failed(EngineUnavailable("connection refused"))  # the gateway saw it die
        await _until(lambda: engine.health_checks >= 2)
        engine.up = True  # restarted (serving an older version from disk)
        await _until(lambda: loader.calls.count(("load", 2)) == 2)
        await _until(lambda: admission.holds == 0)
        task.cancel()

    asyncio.run(main())
    assert loader.calls == [("load", 2), ("rejoin", -1), ("load", 2)]
    assert admission.served_version == 2


class HeldGroups(FakeDispatcher):
    """Groups whose model calls are held at the gate: they cannot finish before the gate reopens."""

    def __init__(self, gate) -> None:
        self.gate = gate

    async def wait_idle(self) -> None:
        await self.gate._up.wait()


@pytest.mark.parametrize("mode", ["retract", "in_place", "drain"])
def test_held_calls_go_on_only_after_the_restarted_engine_reloaded(mode: str, monkeypatch) -> None:
    """With a request gate (the gateways'), a loader's restarted engine reloads the newest version before
    the held model calls are released, and the reload does not wait for the held groups (drain)."""
    from prime_async.weights.request_gate import RequestGate

    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(engine_outage, "BACKOFF_MAX_S", 0.04)
    engine, admission, loader, gate = FakeEngine(), FakeAdmission(), RecordingLoader(latest=2), RequestGate()
    engine.up = True
    watcher = ww.WeightWatcher(
        engines=[engine], admission=admission, groups=HeldGroups(gate),
        settings=WatcherSettings(mode, 1, 60.0), loader=loader, request_gate=gate,
    )  # type: ignore[arg-type]  # fmt: skip
    up_at_reload: list[bool] = []
    load = loader.load

    async def recording_load(engines, version: int, *, flush_cache: bool) -> None:
        up_at_reload.append(gate.engines_up)
        await load(engines, version, flush_cache=flush_cache)

    loader.load = recording_load  # type: ignore[method-assign]

    async def main() -> None:
        task = asyncio.create_task(watcher.run())
        await _until(lambda: admission.served_version == 2)
        engine.up = False
        gate.engine_failed(EngineUnavailable("connection refused"))  # what the gateway calls
        assert not gate.engines_up and admission.holds == 1
        await _until(lambda: engine.health_checks >= 2)
        engine.up = True
        await _until(lambda: gate.engines_up, timeout_s=5.0)
        task.cancel()

    asyncio.run(main())
    assert loader.calls == [("load", 2), ("rejoin", -1), ("load", 2)]
    assert up_at_reload == [True, False]  # the reload ran while the calls were still held


class Schedule:
    async def wait_loadable(self, version: int) -> None:
        return None


def test_deterministic_outage_at_v0_sends_the_held_calls_to_the_initial_model(monkeypatch) -> None:
    """Deterministic, nothing loaded yet (v0 served): the restarted engine serves the initial model, v0,
    which a loader cannot send; the held calls go on at once and v1 loads after them, in turn."""
    from prime_async.weights.request_gate import RequestGate

    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.01)
    engine, admission, loader, gate = FakeEngine(), FakeAdmission(), RecordingLoader(latest=1), RequestGate()
    watcher = ww.WeightWatcher(
        engines=[engine], admission=admission, groups=HeldGroups(gate),
        settings=WatcherSettings("drain", 1, 60.0), loader=loader, request_gate=gate, schedule=Schedule(),
    )  # type: ignore[arg-type]  # fmt: skip

    async def main() -> None:
        gate.engine_failed(EngineUnavailable("connection refused"))  # down before v1 could load
        task = asyncio.create_task(watcher.run())
        await _until(lambda: engine.health_checks >= 2)
        engine.up = True
        await _until(lambda: admission.served_version == 1)
        task.cancel()

    asyncio.run(main())
    assert loader.calls == [("rejoin", -1), ("load", 1)]  # v0 was never asked of the loader
