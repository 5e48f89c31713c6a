"""Dispatcher with scripted episode latencies: granularity, exact cancel accounting, failure propagation."""

from __future__ import annotations

import asyncio

import pytest

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.dispatcher import Dispatcher
from prime_async.orchestrator.ledger import Ledger
from prime_async.orchestrator.simulation import run_virtual
from prime_async.orchestrator.train_sink import TrainSink
from prime_async.orchestrator.types import Episode


class ScriptedSource:
    """Episode `g<gid>-e<i>` takes `latency[(gid, i)]` simulated seconds (default 1 s)."""

    def __init__(
        self, latency: dict[tuple[int, int], float] | None = None, fail_group: int | None = None, status="ok"
    ):
        self.latency = latency or {}
        self.fail_group = fail_group
        self.status = status

    @property
    def num_examples(self) -> int:
        return 10

    async def run_episode(self, *, example_id: int, engine_key: str, sampling: dict) -> Episode:
        gid, idx = (int(x[1:]) for x in engine_key.split("-"))
        await asyncio.sleep(self.latency.get((gid, idx), 1.0))
        if gid == self.fail_group:
            raise KeyError("bug in the rollout source")
        return Episode(example_id=example_id, token_ids=[1, 2], loss_mask=[False, True],
                       sampler_logprobs=[0.0, -1.0], token_versions=[-1, 0], reward=float(idx),
                       status=self.status)  # fmt: skip


def build(source, *, granularity="group", max_inflight=2, k=8, group_size=2, retry=True, max_dropped=100):
    loop = asyncio.get_running_loop()
    ledger, data = Ledger(), DataSource(num_examples=10, seed=0, shuffle=False)
    box: list[TrainSink] = []
    admission = AdmissionController(
        max_inflight_groups=max_inflight, max_buffered_groups=100, max_off_policy_steps=k,
        group_size=group_size, granularity=granularity, buffered_groups=lambda: box[0].num_buffered_groups,
        clock=loop.time,
    )  # fmt: skip
    disp = Dispatcher(source=source, data=data, admission=admission, ledger=ledger, group_size=group_size,
                      sampling={}, retry_unused=retry, clock=loop.time)  # fmt: skip
    unused = "retry" if retry else "drop"
    sink = TrainSink(cfg=SinkConfig(), batch_groups=1, max_off_policy_steps=k, seq_len=64,
                     unused_handler=unused, max_dropped_groups_per_step=max_dropped,
                     listener=disp)  # fmt: skip
    box.append(sink)
    disp.attach_sink(sink)
    return disp, admission, ledger, sink, data


def dispatch_times(granularity: str) -> dict[int, float]:
    async def go():
        # group 0: one fast and one straggler episode; group 1: the mirror image
        source = ScriptedSource({(0, 0): 1.0, (0, 1): 100.0, (1, 0): 100.0, (1, 1): 1.0})
        disp, *_ = build(source, granularity=granularity)
        times: dict[int, float] = {}
        original = disp._dispatch_group

        def record():
            times[disp._next_group_id] = asyncio.get_running_loop().time()
            original()

        disp._dispatch_group = record
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(50.0)
        task.cancel()
        await disp.stop()
        return times

    return run_virtual(go())


def test_sample_granularity_frees_slots_per_episode_group_waits_for_whole_group():
    sample, group = dispatch_times("sample"), dispatch_times("group")
    assert sample[0] == sample[1] == group[0] == group[1] == 0.0
    # sample: at t=1 two episodes finished (one per group) = group_size free slots -> group 2 goes out
    assert sample[2] == pytest.approx(1.0)
    # group: both groups hold their slot until their straggler returns at t=100
    assert 2 not in group


def test_cancel_accounting_is_exact_and_immediate():
    async def go():
        disp, admission, ledger, sink, data = build(ScriptedSource({(2, 0): 50.0, (2, 1): 50.0}), k=1,
                                                    max_inflight=3)  # fmt: skip
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(0.5)
        admission.set_served_version(1)  # groups 0,1,2 were stamped 0; the next ones 1
        await asyncio.sleep(2.0)  # groups 0 and 1 finished (in the sink), group 2 still running
        assert disp.num_inflight_groups >= 1 and 2 in disp._inflight
        admission.on_batch_cut(1)  # next batch 2: stamped-0 groups can never ship
        cancelled = disp.cancel_unshippable()
        assert cancelled == [2]  # the only stamped-0 group still in flight
        assert all(s.group.dispatch_version == 1 for s in disp._inflight.values())
        assert ledger.counts["cancelled"] == 2 * len(cancelled)
        ledger.check(inflight=disp.num_inflight_episodes, buffered=sink.num_buffered_episodes)
        assert admission.groups_not_returned == disp.num_inflight_groups
        assert data.num_retry_pending == len(cancelled)  # unused_handler = retry
        task.cancel()
        await disp.stop()

    run_virtual(go())


def test_rollout_source_bug_fails_run():
    async def go():
        disp, *_ = build(ScriptedSource(fail_group=1))
        with pytest.raises(KeyError, match="bug in the rollout source"):
            await asyncio.wait_for(disp.run(), timeout=10)
        await disp.stop()

    run_virtual(go())


def test_too_many_dropped_groups_fail_run():
    async def go():
        disp, *_ = build(ScriptedSource(status="error"), max_dropped=3)
        with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 3"):
            await asyncio.wait_for(disp.run(), timeout=100)
        await disp.stop()

    run_virtual(go())
