"""EnginePool (`orchestrator/engine_pool.py`) on fake engines and a real watcher, admission and group table:
a joining engine is checked and loaded with the served version before it is in the list; one that is
foreign or dies while joining is dropped with one line and the list is unchanged; a leaving engine waits
for every group in flight; admission's in-flight cap follows the live count; the request files round-trip
(`orchestrator/engine_requests.py`)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineUnavailable
from prime_async.orchestrator import engine_requests as requests
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.engine_pool import EnginePool
from prime_async.orchestrator.engine_requests import EngineRequest, EngineResult
from prime_async.orchestrator.groups import GroupTable
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.watcher import WeightWatcher
from prime_async.weights.watcher_peers import WatcherSettings

RUN = "run-a"


class FakeEngine:
    """An engine's admin side: health, identity, its served version and the loads it was given."""

    def __init__(self, url: str, *, version: int = 0, run_id: str = RUN, die_on_load: bool = False):
        self.base_url, self.version, self.run_id, self.die_on_load = url, version, run_id, die_on_load
        self.loads: list[tuple[str, int]] = []
        self.closed = False

    async def health(self) -> bool:
        return True

    async def model_info(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "model_path": "m", "weight_version": str(self.version)}

    async def weight_version(self) -> int:
        return self.version

    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool) -> None:
        if self.die_on_load:
            raise EngineUnavailable(f"{self.base_url}/update_weights_from_disk: ConnectError")
        self.loads.append((path, version))
        self.version = version

    async def aclose(self) -> None:
        self.closed = True


class Broadcasts:
    def latest_stable(self) -> int | None:
        return 3

    def path(self, version: int) -> str:
        return f"/b/step_{version}"


class World:
    def __init__(self, tmp_path: Path, made: dict[str, FakeEngine], *, served: int = 3):
        cfg = OrchestratorConfig(output_dir=tmp_path, inference={"run_id": RUN})
        self.engines: list[Any] = [FakeEngine("http://e0", version=served)]
        self.groups = GroupTable(group_size=1, batch_groups=4, max_off_policy_steps=8,
                                 data=DataSource(num_examples=8), retry_unused=False,
                                 max_dropped_groups_per_step=1)  # fmt: skip
        self.admission = AdmissionController(groups=self.groups, max_inflight_groups=3, max_buffered_groups=8,
                                             granularity="group", served_version=served)  # fmt: skip
        self.watcher = WeightWatcher(
            engines=self.engines, loader=FilesystemLoader(Broadcasts()), admission=self.admission,
            groups=self.groups, settings=WatcherSettings("retract", 1, 0.5),
        )  # fmt: skip
        self.pool = EnginePool(cfg, self.engines, watcher=self.watcher, admission=self.admission,
                               groups=self.groups, make_client=lambda url, key: made[url])  # fmt: skip


def test_joining_engine_is_loaded_with_the_served_version_before_it_is_routed(tmp_path: Path):
    async def go():
        new = FakeEngine("http://e1")
        world = World(tmp_path, {"http://e1": new})
        assert world.watcher.engines is world.engines  # one list: gateways, watcher and pool share it
        result = await world.pool.handle(EngineRequest("add", "http://e1", timeout_s=5))
        assert result.ok and result.engines == ("http://e0", "http://e1"), result
        assert new.loads == [("/b/step_3", 3)] and world.engines[-1] is new
        assert world.admission.max_inflight_groups == 6  # 3 per engine at start, 2 engines now
        assert world.watcher.metrics()["inference/engines"] == 2.0

    asyncio.run(go())


def test_an_engine_joining_a_run_at_version_0_loads_the_runs_model(tmp_path: Path):
    """A run rolled back to step 0 (a restart without a checkpoint) serves v0, which no broadcast holds;
    an engine that an earlier lifetime loaded with v1 joins again with the run's own model."""

    async def go():
        new = FakeEngine("http://e1", version=1)
        world = World(tmp_path, {"http://e1": new}, served=0)
        result = await world.pool.handle(EngineRequest("add", "http://e1", timeout_s=5))
        assert result.ok and new.loads == [(str(world.pool.cfg.model.path), 0)], (result, new.loads)

    asyncio.run(go())


def test_foreign_engine_or_one_that_dies_while_joining_is_dropped_with_one_line(tmp_path: Path, caplog):
    async def go():
        foreign, dying = FakeEngine("http://x", run_id="other"), FakeEngine("http://d", die_on_load=True)
        world = World(tmp_path, {"http://x": foreign, "http://d": dying})
        with caplog.at_level(logging.WARNING, logger="prime_async.orchestrator.engine_pool"):
            refused = await world.pool.handle(EngineRequest("add", "http://x", timeout_s=5))
            died = await world.pool.handle(EngineRequest("add", "http://d", timeout_s=5))
        assert not refused.ok and "belongs to run other" in refused.message
        assert not died.ok and "ConnectError" in died.message
        assert [e.base_url for e in world.engines] == ["http://e0"] and foreign.closed and dying.closed
        assert world.admission.max_inflight_groups == 3
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and all("refused" in line and "\n" not in line for line in lines), lines

    asyncio.run(go())


def test_join_waits_for_a_running_update_and_gets_its_version(tmp_path: Path):
    async def go():
        new = FakeEngine("http://e1")
        world = World(tmp_path, {"http://e1": new})
        await world.watcher.pin.acquire()  # an update (or a shared-placement eval) is running
        join = asyncio.create_task(world.pool.handle(EngineRequest("add", "http://e1", timeout_s=5)))
        await asyncio.sleep(0.05)
        assert not join.done() and len(world.engines) == 1
        world.admission.set_served_version(4)  # the update loaded v4, then lets go of the pin
        world.watcher.pin.release()
        assert (await join).ok and new.loads == [("/b/step_4", 4)]

    asyncio.run(go())


def test_leaving_engine_waits_for_every_group_in_flight(tmp_path: Path):
    async def go():
        world = World(tmp_path, {"http://e1": FakeEngine("http://e1")})
        assert (await world.pool.handle(EngineRequest("add", "http://e1", timeout_s=5))).ok
        world.groups._idle.clear()  # a group is in flight
        leave = asyncio.create_task(world.pool.handle(EngineRequest("remove", "http://e0", timeout_s=5)))
        await asyncio.sleep(0.05)
        assert not leave.done() and world.admission.blocked_reason() == "hold" and len(world.engines) == 2
        world.groups._idle.set()
        result = await leave
        assert result.ok and result.engines == ("http://e1",) and world.admission.blocked_reason() is None
        assert world.admission.max_inflight_groups == 3
        last = await world.pool.handle(EngineRequest("remove", "http://e1", timeout_s=5))
        assert not last.ok and "last engine" in last.message and len(world.engines) == 1

    asyncio.run(go())


def test_a_drain_past_its_deadline_keeps_the_engine_and_releases_admission(tmp_path: Path):
    async def go():
        world = World(tmp_path, {"http://e1": FakeEngine("http://e1")})
        assert (await world.pool.handle(EngineRequest("add", "http://e1", timeout_s=5))).ok
        world.groups._idle.clear()
        result = await world.pool.handle(EngineRequest("remove", "http://e0", timeout_s=0.1))
        assert not result.ok and "deadline" in result.message and len(world.engines) == 2
        assert world.admission.blocked_reason() is None

    asyncio.run(go())


def test_request_files_round_trip_and_a_malformed_one_is_answered(tmp_path: Path):
    rid = requests.submit(tmp_path, EngineRequest("add", "http://h:1/", timeout_s=7))
    (requests.engines_dir(tmp_path) / "requests" / "0-bad.json").write_text(json.dumps({"op": "grow"}))
    (got_bad, bad), (got, req) = requests.pending(tmp_path)
    assert got_bad == "0-bad" and isinstance(bad, ValueError) and "'grow'" in str(bad)
    assert got == rid and req == EngineRequest("add", "http://h:1", None, 7.0)
    requests.answer(tmp_path, rid, EngineResult(True, "joined", ("http://h:1",)))
    assert requests.wait_result(tmp_path, rid, timeout_s=1) == EngineResult(True, "joined", ("http://h:1",))
    assert [r for r, _ in requests.pending(tmp_path)] == ["0-bad"]
    assert requests.wait_result(tmp_path, "nobody", timeout_s=0.1) is None
    mode = (requests.engines_dir(tmp_path) / "results" / f"{rid}.json").stat().st_mode & 0o777
    assert mode == 0o600


@pytest.mark.parametrize("transport", ["distributed", "shared"])
def test_other_weight_transports_refuse_to_add(tmp_path: Path, transport: str):
    world = World(tmp_path, {})
    world.pool.cfg = world.pool.cfg.model_copy(update={"weights": world.pool.cfg.weights.model_copy(
        update={"transport": transport})})  # fmt: skip
    result = asyncio.run(world.pool.handle(EngineRequest("add", "http://e1", timeout_s=1)))
    assert not result.ok and f"transport = {transport!r}" in result.message


def test_a_restarted_orchestrator_makes_the_changes_again(tmp_path: Path):
    async def go():
        world = World(tmp_path, {"http://e1": FakeEngine("http://e1")})
        assert (await world.pool.handle(EngineRequest("add", "http://e1", "key-1", timeout_s=5))).ok
        assert (await world.pool.handle(EngineRequest("remove", "http://e0", timeout_s=5))).ok
        saved = json.loads((requests.engines_dir(tmp_path) / "membership.json").read_text())
        assert saved == {"run_id": RUN, "added": {"http://e1": "key-1"}, "removed": ["http://e0"]}
        # the next lifetime starts with the configured engine, then joins e1 again (loaded) and drops e0
        again = FakeEngine("http://e1")
        restarted = World(tmp_path, {"http://e1": again}, served=5)
        await restarted.pool.restore()
        assert [e.base_url for e in restarted.engines] == ["http://e1"] and again.loads == [("/b/step_5", 5)]
        # another run's file changes nothing
        other = World(tmp_path, {"http://e1": FakeEngine("http://e1")})
        inference = other.pool.cfg.inference.model_copy(update={"run_id": "run-b"})
        other.pool.cfg = other.pool.cfg.model_copy(update={"inference": inference})
        await other.pool.restore()
        assert [e.base_url for e in other.engines] == ["http://e0"]

    asyncio.run(go())
