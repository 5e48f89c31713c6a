"""The token rule (`sink.stragglers = "partial"`): per-token staleness, masking at the cut, the token
ledger, the straggler budget, and a sink that cuts without the straggler and trains it later."""

from __future__ import annotations

import asyncio

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.straggler_budget import StragglerBudget
from prime_async.orchestrator.token_staleness import (
    effective_deadline,
    expiring_share,
    loss_token_ages,
    mask_stale,
    trainable_tokens,
)
from prime_async.orchestrator.train_sink import TrainSink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


def episode(versions: list[int], prompt: int = 2) -> Episode:
    n = prompt + len(versions)
    mask = [False] * prompt + [True] * len(versions)
    return Episode(example_id=0, token_ids=[1] * n, loss_mask=mask, sampler_logprobs=[0.0] * n,
                   token_versions=[-1] * prompt + versions, reward=0.5)  # fmt: skip


def group(gid: int, d: int, *versions: list[int]) -> Group:
    eps = [episode(v) for v in versions]
    for i, ep in enumerate(eps):
        ep.reward = float(i % 2)
    return Group(group_id=gid, example_id=gid, dispatch_version=d, episodes=eps)


def test_trainable_masked_and_deadlines():
    g = group(0, 1, [1, 1, 2], [1, -1, 3, 3])  # an unknown version counts as the dispatch version
    assert trainable_tokens(g, 3, 1) == 3 and trainable_tokens(g, 4, 1) == 2
    assert effective_deadline(g, 3, 1) == 3  # the version-2 token is the oldest batch 3 may train
    assert expiring_share(g, 3, 1) == 1 / 3
    assert mask_stale(g, 3, 1) == 4
    assert loss_token_ages(g, 3) == [1, 0, 0] and max(loss_token_ages(g, 3)) <= 1
    assert g.episodes[0].loss_mask == [False, False, False, False, True]
    on_time = group(1, 2, [2, 2])
    assert effective_deadline(on_time, 3, 1) == 3 and expiring_share(on_time, 3, 1) == 1.0


def _sink(k: int, wait_s: float | None, batch_groups: int = 1) -> TrainSink:
    table = GroupTable(group_size=2, batch_groups=batch_groups, max_off_policy_steps=k,
                       data=DataSource(num_examples=10), retry_unused=False, max_dropped_groups_per_step=100,
                       token_rule=True)  # fmt: skip
    cfg = SinkConfig(stragglers="partial", straggler_wait_s=wait_s)
    return TrainSink(cfg=cfg, batch_groups=batch_groups, max_off_policy_steps=k, seq_len=64, groups=table)


def _arrive(sink: TrainSink, g: Group) -> None:
    sink.groups.dispatch(g)
    for _ in g.episodes:
        sink.groups.episode_done(g)
    sink.groups.finish(g)
    sink.put(g)


def test_the_cut_leaves_the_straggler_and_trains_its_fresh_tokens_later():
    async def run() -> None:
        sink = _sink(k=1, wait_s=0.0)
        straggler = Group(group_id=0, example_id=0, dispatch_version=0)
        sink.groups.dispatch(straggler)  # in flight, deadline batch 1
        _arrive(sink, group(1, 0, [0, 0], [0]))
        assert [g.group_id for g in await sink.get_batch(0)] == [1]
        _arrive(sink, group(2, 1, [1], [1]))
        assert [g.group_id for g in await sink.get_batch(1)] == [2]  # no wait for group 0 (budget 0)
        assert sink.groups.num_inflight_groups == 1  # not cancelled: it keeps generating
        straggler.episodes = [episode([0, 0, 2]), episode([2, 2])]  # its later turns under version 2
        for _ in straggler.episodes:
            sink.groups.episode_done(straggler)
        sink.groups.finish(straggler)
        sink.put(straggler)
        batch = await sink.get_batch(3)  # batch 3, K = 1: the version-0 tokens are masked
        assert batch == [straggler] and max(loss_token_ages(straggler, 3)) == 1
        tokens = sink.groups.token_counts()
        assert tokens["masked_stale"] == 2 and tokens["trained"] == 3 + 2 + 3
        sink.groups.check()

    asyncio.run(run())


def test_a_group_with_nothing_fresh_is_dropped_stale_and_its_prompt_retried():
    async def run() -> None:
        sink = _sink(k=1, wait_s=0.0)
        _arrive(sink, group(0, 0, [0, 0], [0]))
        _arrive(sink, group(1, 2, [2], [2]))
        assert [g.group_id for g in await sink.get_batch(2)] == [1]
        counts = sink.groups.token_counts()
        assert counts["dropped_stale"] == 3 and sink.groups.metrics()["ledger/prompts_lost"] == 0
        assert sink.groups.data.num_retry_pending == 1

    asyncio.run(run())


def test_the_cut_waits_the_budget_for_a_straggler_then_goes_ahead():
    async def run() -> None:
        sink = _sink(k=1, wait_s=0.2, batch_groups=1)
        late = Group(group_id=0, example_id=0, dispatch_version=0)
        sink.groups.dispatch(late)  # deadline batch 1, still running
        _arrive(sink, group(1, 1, [1], [1]))
        loop = asyncio.get_running_loop()
        start = loop.time()
        batch = await sink.get_batch(1)
        assert [g.group_id for g in batch] == [1] and loop.time() - start >= 0.19

    asyncio.run(run())


def test_adaptive_budget_waits_more_while_tokens_are_lost_and_less_when_not():
    budget = StragglerBudget(fixed_s=None, discard_budget=0.02)
    for step in range(10):  # 10% discarded, a cut every 2 s
        budget.observe(2.0 * step, discarded=10 * step, generated=100 * step)
    assert budget.share() == 0.1 and budget.seconds() > 0.5 * 2.0
    high = budget.factor
    for step in range(10, 40):  # nothing more discarded
        budget.observe(2.0 * step, discarded=90, generated=100 * step)
    assert budget.factor < high and budget.seconds() < 0.5
    assert StragglerBudget(fixed_s=1.5, discard_budget=0.02).seconds() == 1.5
