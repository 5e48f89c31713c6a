"""`deterministic = true` in the orchestrator: the fixed schedule, the dispatch-order sink, the seeds,
and the whole orchestrator on simulated engines (virtual clock) under very different timings.

The bit-identical end-to-end runs (real processes) are in `test_deterministic.py`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prime_async.config.orchestrator import OrchestratorConfig, SinkConfig
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.schedule import DeterministicSchedule
from prime_async.orchestrator.train_sink import DeterministicSink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.seeds import call_seed, derive_seed, episode_seed
from prime_async.rollouts.types import Episode
from prime_async.simulation import SimParams, run_simulation, run_virtual


def test_schedule_versions_blocking_and_loadability():
    s = DeterministicSchedule(batch_groups=2, max_off_policy_steps=1, max_steps=4, seed=0)
    assert [s.dispatch_version(n) for n in range(4)] == [0, 0, 1, 2]
    assert not s.blocked(0) and not s.loadable(1)  # batches 0 and 1 (version 0) are not dispatched yet
    taken = [s.take_slot() for _ in range(4)]  # batches 0 and 1
    assert taken == [0, 1, 2, 3] and s.batch_dispatched(1) and not s.batch_dispatched(2)
    assert s.blocked(0) and s.loadable(1) and not s.loadable(2)  # slot 4 belongs to version 1
    assert not s.blocked(1)
    s.take_slot(), s.take_slot(), s.take_slot(), s.take_slot()
    assert s.next_version() is None and s.blocked(3) and s.loadable(10)  # the run is dispatched
    late = DeterministicSchedule(batch_groups=1, max_off_policy_steps=0, max_steps=3, seed=0)
    with pytest.raises(RuntimeError, match=r"slot 0 \(batch 0\) belongs to version 0 but the engines"):
        late.blocked(1)
    resumed = DeterministicSchedule(batch_groups=3, max_off_policy_steps=2, max_steps=9, seed=0, start_step=5)
    # resumed at step 5: the engines serve version 5 (the rollback loaded it), so batches 5 and 6 go out
    # at 5, not at 3 and 4, whose weights are gone
    assert resumed.next_slot == 15 and resumed.next_version() == 5


def test_seeds_are_stable_across_processes_and_distinct():
    """Seeds are a hash of the episode's identity, not Python's per-process `hash` (PYTHONHASHSEED)."""
    here = episode_seed(7, "reverse-text", 3, 0, 1)
    code = (
        "from prime_async.rollouts.seeds import episode_seed; print(episode_seed(7, 'reverse-text', 3, 0, 1))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(other.stdout) == here
    seeds = {episode_seed(7, env, ex, epoch, i) for env in ("a", "b") for ex in range(5) for epoch in (0, 1)
             for i in range(4)}  # fmt: skip
    assert len(seeds) == 2 * 5 * 2 * 4  # every episode identity has its own seed
    assert all(0 <= x < 2**63 for x in seeds)
    assert len({call_seed(here, c) for c in range(10)}) == 10
    assert derive_seed(1, 2) != derive_seed(2, 1)


def _dispatched(table: GroupTable, schedule: DeterministicSchedule, d: int = 0, status: str = "ok") -> Group:
    """A group of the next slot, in flight (what the dispatcher does in one synchronous block)."""
    gid = schedule.take_slot()
    ep = Episode(example_id=gid, token_ids=[1, 2], loss_mask=[False, True], sampler_logprobs=[0.0, -1.0],
                 token_versions=[-1, d], reward=float(gid), status=status)  # fmt: skip
    group = Group(group_id=gid, example_id=gid, dispatch_version=d, episodes=[ep])
    table.dispatch(group)
    return group


def _finish(sink: DeterministicSink, group: Group) -> None:
    sink.groups.episode_done(group)
    sink.groups.finish(group)
    sink.put(group)


def test_sink_cuts_by_slot_not_by_completion_order():
    table = GroupTable(group_size=1, batch_groups=2, max_off_policy_steps=1, data=DataSource(num_examples=50),
                       retry_unused=False, max_dropped_groups_per_step=10)  # fmt: skip
    schedule = DeterministicSchedule(batch_groups=2, max_off_policy_steps=1, max_steps=3, seed=0)
    sink = DeterministicSink(cfg=SinkConfig(), schedule=schedule, batch_groups=2, max_off_policy_steps=1,
                             seq_len=8, groups=table)  # fmt: skip

    async def go() -> None:
        groups = [_dispatched(table, schedule) for _ in range(4)]
        # slots finish in the order 3, 2, 1, 0: batch 0 must still be {0, 1} and batch 1 {2, 3}
        for gid in (3, 2, 1):
            _finish(sink, groups[gid])
        pending = asyncio.ensure_future(sink.get_batch(0))
        await asyncio.sleep(0.01)
        assert not pending.done()  # slot 0 is still in flight: groups of batch 1 never fill it
        _finish(sink, groups[0])
        assert [g.group_id for g in await asyncio.wait_for(pending, 1)] == [0, 1]
        assert [g.group_id for g in await asyncio.wait_for(sink.get_batch(1), 1)] == [2, 3]
        pending = asyncio.ensure_future(sink.get_batch(2))
        await asyncio.sleep(0.01)
        assert not pending.done()  # batch 2 is not even dispatched
        for _ in range(2):
            _finish(sink, _dispatched(table, schedule, d=1, status="error"))
        with pytest.raises(RuntimeError, match=r"every group of batch 2 \(slots 4\.\.5\) was dropped"):
            await asyncio.wait_for(pending, 1)

    asyncio.run(go())


def _run(k: int, params: SimParams, **kw) -> dict[int, list[tuple[int, int, int]]]:
    cfg = OrchestratorConfig(max_steps=8, batch_groups=3, group_size=2, max_off_policy_steps=k,
                             deterministic=True, wandb={"enabled": False}, **kw)  # fmt: skip
    result = run_virtual(run_simulation(cfg, params))
    out = {}
    for step, groups in result.trained.items():
        for g in groups:
            assert g.dispatch_version == max(0, step - k)  # staleness exactly min(step, K)
            for ep in g.episodes:  # drained updates: no episode spans two versions
                assert ep.span.start == ep.span.end == g.dispatch_version
        out[step] = [(g.group_id, g.example_id, g.dispatch_version) for g in groups]
    for engine in result.engines:  # every version loaded, in turn, none skipped
        loaded = [args[1] for name, args in engine.calls if name == "update"]
        assert loaded == list(range(1, len(loaded) + 1)) and len(loaded) >= 8 - 1 - k
    assert result.comps.groups.counts()["cancelled"] == 0
    return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.sampled_from([0, 1, 2]),
    seed=st.integers(0, 2**16),
    latency=st.floats(0.05, 5.0),
    train_time=st.floats(0.01, 5.0),
    buffer_factor=st.integers(1, 3),
    inflight=st.integers(1, 8),
)
def test_batches_do_not_depend_on_timing_or_caps(k, seed, latency, train_time, buffer_factor, inflight):
    """Very different engine latencies, training times, caps: the same groups in the same batches."""
    reference = _run(k, SimParams(seed=0, latency_s=1.0, train_time_s=1.0))
    assert [[gid for gid, _, _ in batch] for batch in reference.values()] == [
        [3 * n, 3 * n + 1, 3 * n + 2] for n in range(8)
    ]
    other = _run(
        k, SimParams(seed=seed, latency_s=latency, pareto_alpha=1.1, train_time_s=train_time),
        admission={"max_buffered_groups": 3 * buffer_factor, "max_inflight_groups": inflight,
                   "submission_granularity": "group"}, weights={"pause_mode": "retract"},
    )  # fmt: skip
    assert other == reference


def test_config_rules():
    with pytest.raises(ValueError, match=r"weights\.update_interval must be 1"):
        OrchestratorConfig(deterministic=True, max_off_policy_steps=2, weights={"update_interval": 2})
    with pytest.raises(ValueError, match=r"remove batch\.sink\.import_path"):
        OrchestratorConfig(deterministic=True, batch={"sink": {"import_path": "x:Y"}})


def test_a_resumed_schedule_dispatches_at_the_version_the_engines_serve() -> None:
    """Regression (feature matrix: deterministic x a kill with restarts): after a rollback to step 2 the
    engines serve version 2, but batch 2's slots belonged to version 2 - K = 1, so the resumed orchestrator
    died with 'deterministic schedule broken' on every restart. Batches c .. c + K - 1 of a run resumed at
    step c are dispatched at version c."""
    from prime_async.orchestrator.schedule import DeterministicSchedule

    schedule = DeterministicSchedule(
        batch_groups=2, max_off_policy_steps=1, max_steps=6, seed=0, start_step=2
    )
    assert [schedule.dispatch_version(n) for n in range(2, 6)] == [2, 2, 3, 4]
    assert schedule.next_slot == 4 and not schedule.blocked(served_version=2)
    fresh = DeterministicSchedule(batch_groups=2, max_off_policy_steps=1, max_steps=6, seed=0)
    assert [fresh.dispatch_version(n) for n in range(4)] == [0, 0, 1, 2], "a fresh run is unchanged"
