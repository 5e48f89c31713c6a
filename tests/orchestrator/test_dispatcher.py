"""Dispatcher with scripted episode latencies: granularity, exact cancel accounting, failure propagation."""

from __future__ import annotations

import asyncio

import pytest

from prime_async.config.orchestrator import SinkConfig
from prime_async.engine_api import SamplingParams
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.dispatcher import Dispatcher
from prime_async.orchestrator.env_mix import EnvMix
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.train_sink import TrainSink
from prime_async.rollouts.episode_errors import EpisodesFailing
from prime_async.rollouts.types import Episode, NoGateway
from prime_async.simulation import run_virtual


class ScriptedSource(NoGateway):
    """Episode `g<gid>-e<i>` takes `latency[(gid, i)]` simulated seconds (default 1 s)."""

    def __init__(
        self, latency: dict[tuple[int, int], float] | None = None, fail_group: int | None = None, status="ok",
        error: str | None = None, seats: tuple[str, ...] = (), kind: str | None = None,
    ):  # fmt: skip
        self.kind = kind  # the episodes' `env_error`
        self.latency = latency or {}
        self.fail_group = fail_group
        self.status = status
        self.error = error
        self.seats = seats  # non-empty: every episode returns one trajectory per seat

    @property
    def num_examples(self) -> int:
        return 10

    async def run_episode(
        self, *, example_id: int, engine_key: str, sampling: SamplingParams, replay=None
    ) -> Episode | list[Episode]:
        gid, idx = (int(x[1:]) for x in engine_key.split("-"))
        await asyncio.sleep(self.latency.get((gid, idx), 1.0))
        if gid == self.fail_group:
            raise KeyError("bug in the rollout source")
        eps = [Episode(example_id=example_id, token_ids=[1, 2], loss_mask=[False, True],
                       sampler_logprobs=[0.0, -1.0], token_versions=[-1, 0], reward=float(idx) + j,
                       status=self.status, error=self.error, seat=seat)
               for j, seat in enumerate(self.seats or ("agent",))]  # fmt: skip
        for ep in eps:
            if self.kind is not None:
                ep.metrics["env_error"] = self.kind
        return eps if self.seats else eps[0]


def build(
    source,
    *,
    granularity="group",
    max_inflight=2,
    k=8,
    group_size=2,
    retry=True,
    max_dropped=100,
    fail_fast=2,
    batch_groups=1,
):
    loop = asyncio.get_running_loop()
    data = DataSource(num_examples=10, seed=0, shuffle=False)
    groups = GroupTable(group_size=group_size, batch_groups=batch_groups, max_off_policy_steps=k, data=data,
                        retry_unused=retry, max_dropped_groups_per_step=max_dropped)  # fmt: skip
    admission = AdmissionController(groups=groups, max_inflight_groups=max_inflight, max_buffered_groups=100,
                                    granularity=granularity, clock=loop.time)  # fmt: skip
    sink = TrainSink(cfg=SinkConfig(), batch_groups=batch_groups, max_off_policy_steps=k, seq_len=64,
                     groups=groups)  # fmt: skip
    envs = EnvMix.single(source=source, data=data, sampling=SamplingParams())
    disp = Dispatcher(envs=envs, admission=admission, groups=groups, sink=sink, clock=loop.time,
                      fail_fast_groups=fail_fast)  # fmt: skip
    return disp, admission, groups, sink, data


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
        disp, admission, groups, _sink, data = build(ScriptedSource({(2, 0): 50.0, (2, 1): 50.0}), k=1,
                                                    max_inflight=3, batch_groups=3)  # fmt: skip
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(0.5)
        admission.set_served_version(1)  # groups 0,1,2 were stamped 0; the next ones 1
        await asyncio.sleep(2.0)  # groups 0 and 1 finished (in the sink), group 2 still running
        assert groups.is_inflight(2)
        task_2 = next(t for t in groups.tasks() if t.get_name() == "group-2")
        batch = groups.buffered()[:1]
        groups.take(batch, step=1)  # next batch 2: stamped-0 groups can never ship; the cut cancels them
        assert not groups.is_inflight(2) and groups.counts()["cancelled"] == 2
        assert all(g.dispatch_version == 1 for g in groups.inflight())
        groups.check()
        assert data.num_retry_pending == 1  # unused_handler = retry
        await asyncio.sleep(0.1)
        assert task_2.done() and not any(t.done() for t in groups.tasks())  # only group 2 stopped
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
        disp, *_ = build(
            ScriptedSource(status="error", error="reward: boom\nline 2"), max_dropped=3, fail_fast=0
        )
        with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 3") as info:
            await asyncio.wait_for(disp.run(), timeout=100)
        await disp.stop()
        # regression (issue 11): the limit's error used to name only "last reason: errored"
        assert "most frequent episode error (8 of 8 failed episodes): [error] reward: boom | line 2" in str(
            info.value
        )

    run_virtual(go())


def test_every_early_episode_failing_stops_the_run_at_once(caplog: pytest.LogCaptureFixture):
    async def go():
        source = ScriptedSource(status="error", error="rollout: ValueError: Harness 'x' does not support MCP")
        disp, *_ = build(source, max_dropped=100)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EpisodesFailing, match="every episode of the first 2 groups failed") as info:
            await asyncio.wait_for(disp.run(), timeout=100)
        await disp.stop()
        assert "Harness 'x' does not support MCP" in str(info.value)
        assert asyncio.get_running_loop().time() - t0 < 1.5  # the first two groups, not 100 drops
        return disp

    disp = run_virtual(go())
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "episode error" in r.message]
    assert len(warnings) == 1, "one distinct error is logged once"
    assert disp.errors.counts_by_kind() == {"error": 4}


def test_a_prompt_that_does_not_fit_stops_the_run_at_the_first_episode():
    async def go():
        error = (
            "prompt_too_long: the prompt is 486 tokens (chat template and tool schemas included) and "
            "does not fit seq_len = 256: raise seq_len above 486 plus the completion budget"
        )
        source = ScriptedSource(status="error", error=error, kind="prompt_too_long")
        disp, *_ = build(source, max_dropped=100)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EpisodesFailing) as info:
            await asyncio.wait_for(disp.run(), timeout=100)
        await disp.stop()
        assert asyncio.get_running_loop().time() - t0 < 1.5, "refused when the first episodes finish"
        return disp, str(info.value)

    disp, message = run_virtual(go())
    assert message.startswith("env 'default', example 0: the prompt is 486 tokens"), message
    assert "seq_len = 256" in message and disp.errors.counts_by_kind() == {"prompt_too_long": 4}


def test_some_early_successes_keep_the_run_going():
    class HalfFailing(ScriptedSource):
        async def run_episode(self, **kw):
            ep = await super().run_episode(**kw)
            if kw["engine_key"].endswith("e1"):
                ep.status, ep.error = "error", "reward: flaky"
            return ep

    async def go():
        disp, *_ = build(HalfFailing(), max_dropped=100)
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(5.0)
        assert not task.done(), "a group with one ok episode is not an environment that cannot run"
        task.cancel()
        await disp.stop()

    run_virtual(go())


def test_multi_seat_trajectories_are_counted_by_the_group_table():
    async def go():
        disp, _admission, groups, _sink, _data = build(ScriptedSource(seats=("white", "black")))
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(1.5)  # two groups of 2 episodes x 2 seats finished
        assert groups.num_buffered_groups == 2
        group = groups.buffered()[0]
        assert [e.seat for e in group.episodes] == ["white", "black", "white", "black"]
        assert group.seats() == {"white": [0, 2], "black": [1, 3]}
        groups.check()
        counts = groups.counts()
        assert counts["buffered"] == 8 and groups.dispatched == 8 + counts["inflight"]
        task.cancel()
        await disp.stop()

    run_virtual(go())
