"""TrainSink over a real GroupTable: drops on put, the sweep vs K before every cut, FIFO / windowed FIFO, drop
limit, import path."""

from __future__ import annotations

import asyncio

import pytest

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.train_sink import TrainSink, build_train_sink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


def table(*, k=1, unused="drop", max_dropped=100, batch_groups=2) -> GroupTable:
    data = DataSource(num_examples=100, seed=0, shuffle=False)
    return GroupTable(group_size=1, batch_groups=batch_groups, max_off_policy_steps=k, data=data,
                      retry_unused=unused == "retry", max_dropped_groups_per_step=max_dropped)  # fmt: skip


def group(gid: int, d: int = 0, rewards=(0.0, 1.0), status="ok", length=4) -> Group:
    """A group dispatched into no table yet; `finished` runs it through the sink's table."""
    eps = [
        Episode(example_id=gid, token_ids=[1] * length, loss_mask=[True] * length,
                sampler_logprobs=[0.0] * length, token_versions=[d] * length, reward=r, status=status)
        for r in rewards
    ]  # fmt: skip
    return Group(group_id=gid, example_id=gid, dispatch_version=d, episodes=eps)


def finished(sink: TrainSink, g: Group) -> Group:
    """Dispatch `g` into the sink's table and let its episodes return (what the dispatcher does)."""
    sink.groups.dispatch(g)
    sink.groups.episode_done(g)
    sink.groups.finish(g)
    return g


def put(sink: TrainSink, g: Group) -> None:
    sink.put(finished(sink, g))


def make(groups: GroupTable | None = None, *, k=1, batch_groups=2, unused="drop", max_dropped=100,
         **sink_kw) -> TrainSink:  # fmt: skip
    return TrainSink(
        cfg=SinkConfig(**sink_kw),
        batch_groups=batch_groups,
        max_off_policy_steps=k,
        seq_len=8,
        groups=groups or table(k=k, unused=unused, max_dropped=max_dropped, batch_groups=batch_groups),
    )


def ended(sink: TrainSink) -> dict[str, int]:
    return {s: n for s, n in sink.groups.counts().items() if n}


def get(sink: TrainSink, step: int, timeout: float = 0.05):
    async def go():
        return await asyncio.wait_for(sink.get_batch(step), timeout)

    return asyncio.run(go())


def test_put_drops_errored_and_filters_equal_rewards():
    sink = make(reject_equal_reward=True, unused="retry")
    put(sink, group(0, status="error"))
    put(sink, group(1, rewards=(1.0, 1.0)))
    put(sink, group(2))
    assert ended(sink) == {"errored": 2, "filtered": 2, "buffered": 2}
    assert sink.groups.buffered()[0].group_id == 2
    assert sink.groups.data.next_example() == (0, 0)  # the errored prompt is retried
    assert sink.groups.data.num_retry_pending == 0  # filtered prompts never are
    assert sink.groups.metrics()["rollout/buffer/dropped_groups"] == 2


def test_overlong_truncate_or_drop():
    sink = make(overlong="truncate")
    g = group(0, length=12)
    put(sink, g)
    assert all(len(e.token_ids) == 8 and e.truncated for e in g.episodes)
    sink = make(overlong="drop")
    g = group(1, rewards=(0.0, 1.0))
    g.episodes[0].token_ids = [1] * 12
    put(sink, g)
    assert len(g.episodes) == 1 and ended(sink) == {"buffered": 1, "filtered": 1}


def test_overlong_drop_acts_on_episodes_the_gateway_clamped_to_seq_len():
    """Episodes reach the sink already clamped to seq_len (8 here) and flagged `overlong`: "drop" must still
    drop them (it compared lengths only and never dropped anything in a real run)."""
    sink = make(overlong="drop")
    g = group(2, rewards=(0.0, 1.0, 0.5), length=8)
    g.episodes[0].overlong = g.episodes[0].truncated = True
    put(sink, g)
    assert len(g.episodes) == 2 and ended(sink) == {"buffered": 2, "filtered": 1}
    sink = make(overlong="truncate")
    g = group(3, length=8)
    g.episodes[0].overlong = True
    put(sink, g)
    assert len(g.episodes) == 2


def test_sweep_drops_stale_before_every_cut():
    sink = make(k=1, unused="retry")
    for gid, d in [(0, 0), (1, 1), (2, 2)]:
        put(sink, group(gid, d=d))
    batch = get(sink, step=2)  # group 0 has staleness 2 > K=1
    assert [g.group_id for g in batch] == [1, 2]
    assert ended(sink) == {"dropped_stale": 2, "trained": 4}
    assert sink.groups.data.next_example() == (0, 0)  # the stale prompt is retried
    assert sink.groups.next_batch_step == 3


def test_batch_waits_until_enough_shippable_groups():
    sink = make(k=0)
    put(sink, group(0, d=0))
    put(sink, group(1, d=1))
    with pytest.raises(TimeoutError):
        get(sink, step=1)  # only group 1 can ship at step 1
    assert sink.groups.num_buffered_groups == 1


def test_fifo_takes_oldest_arrivals():
    sink = make(batch_groups=2, k=5)
    for gid in (3, 1, 2):
        put(sink, group(gid))
    assert [g.group_id for g in get(sink, 0)] == [3, 1]


def test_windowed_fifo_follows_dispatch_order_within_window():
    sink = make(batch_groups=2, k=5, order="windowed_fifo", window_fraction=0.5)  # window = 1 group
    groups = [finished(sink, group(i)) for i in range(5)]  # all in flight in dispatch order
    sink.put(groups[2])
    sink.put(groups[3])
    with pytest.raises(TimeoutError):
        get(sink, 0)  # window = first 3 in dispatch order; only group 2 of them finished
    sink.put(groups[1])
    assert [g.group_id for g in get(sink, 0)] == [1, 2]  # dispatch order, group 0 skipped (window)
    sink.groups.drop(groups[0], "errored")  # ended in flight: it no longer holds the window
    sink.put(groups[4])
    assert [g.group_id for g in get(sink, 1)] == [3, 4]


def test_windowed_batch_is_cut_as_soon_as_a_group_in_the_window_ends_in_flight():
    """Regression: a group of the window dropped at `put` (errored) used to leave `get_batch` waiting for the
    next arrival; leaving flight now wakes it, so the batch is cut at once."""

    async def go():
        sink = make(batch_groups=2, k=5, order="windowed_fifo", window_fraction=0.5)  # window = 1 group
        groups = [finished(sink, group(i)) for i in range(4)]
        sink.put(groups[2])
        sink.put(groups[3])
        waiting = asyncio.create_task(sink.get_batch(0))
        await asyncio.sleep(0)
        assert not waiting.done()  # groups 0 and 1 are in flight ahead of the window
        groups[0].episodes[0].status = "error"
        sink.put(groups[0])  # dropped: nothing arrives, but the window moves on
        return await asyncio.wait_for(waiting, 0.05)

    assert [g.group_id for g in asyncio.run(go())] == [2, 3]


def test_too_many_drops_between_cuts_fail_the_run():
    sink = make(max_dropped=2)
    put(sink, group(0, status="aborted"))
    put(sink, group(1, status="error"))
    with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 2"):
        put(sink, group(2, status="error"))


def test_drop_counter_resets_at_each_cut():
    sink = make(max_dropped=1, batch_groups=1)
    put(sink, group(0, status="error"))
    put(sink, group(1))
    get(sink, 0)
    put(sink, group(2, status="error"))  # one drop since the last cut: allowed


class MySink(TrainSink):
    pass


def test_import_path_selects_replacement():
    sink = build_train_sink(
        cfg=SinkConfig(import_path=f"{__name__}:MySink"),
        batch_groups=1,
        max_off_policy_steps=1,
        seq_len=8,
        groups=table(),
    )
    assert type(sink) is MySink
    with pytest.raises(ValueError, match="module:Class"):
        build_train_sink(cfg=SinkConfig(import_path="nocolon"), groups=None)


def test_sweep_refuses_negative_staleness():
    """A group dispatched at a version newer than the batch being cut means the engines serve weights of a
    history the trainer does not have (e.g. a restart that did not reload them): an invariant violation."""
    sink = make(k=1)
    put(sink, group(0, d=5))
    with pytest.raises(RuntimeError, match=r"invariant violated: .* \(staleness -2 < 0\)"):
        sink.sweep(3)
