"""TrainSink: drops on put, the sweep vs K before every cut, FIFO / windowed FIFO, drop limit, import path."""

from __future__ import annotations

import asyncio

import pytest

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.train_sink import TrainSink, build_train_sink
from prime_async.orchestrator.types import Episode, Group


class RecordingListener:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_accepted(self, group, *, num_filtered_episodes):
        self.events.append(("accepted", group.group_id, num_filtered_episodes))

    def on_dropped(self, group, *, reason, retry, from_queue):
        self.events.append(("dropped", group.group_id, reason, retry, from_queue))

    def on_trained(self, groups, *, step):
        self.events.append(("trained", step, [g.group_id for g in groups]))


def group(gid: int, d: int = 0, rewards=(0.0, 1.0), status="ok", length=4) -> Group:
    eps = [
        Episode(example_id=gid, token_ids=[1] * length, loss_mask=[True] * length,
                sampler_logprobs=[0.0] * length, token_versions=[d] * length, reward=r, status=status)
        for r in rewards
    ]  # fmt: skip
    return Group(group_id=gid, example_id=gid, dispatch_version=d, episodes=eps)


def make(listener=None, *, k=1, batch_groups=2, unused="drop", max_dropped=100, **sink_kw) -> TrainSink:
    return TrainSink(
        cfg=SinkConfig(**sink_kw),
        batch_groups=batch_groups,
        max_off_policy_steps=k,
        seq_len=8,
        unused_handler=unused,
        max_dropped_groups_per_step=max_dropped,
        listener=listener or RecordingListener(),
    )


def get(sink: TrainSink, step: int, timeout: float = 0.05):
    async def go():
        return await asyncio.wait_for(sink.get_batch(step), timeout)

    return asyncio.run(go())


def test_put_drops_errored_and_filters_equal_rewards():
    lis = RecordingListener()
    sink = make(lis, reject_equal_reward=True, unused="retry")
    sink.put(group(0, status="error"))
    sink.put(group(1, rewards=(1.0, 1.0)))
    sink.put(group(2))
    assert lis.events == [
        ("dropped", 0, "errored", True, False),
        ("dropped", 1, "filtered", False, False),  # filtered prompts are never retried
        ("accepted", 2, 0),
    ]
    assert sink.get_metrics()["rollout/buffer/dropped_groups"] == 2


def test_overlong_truncate_or_drop():
    sink = make(overlong="truncate")
    g = group(0, length=12)
    sink.put(g)
    assert all(len(e.token_ids) == 8 and e.truncated for e in g.episodes)
    lis = RecordingListener()
    sink = make(lis, overlong="drop")
    g = group(1, rewards=(0.0, 1.0))
    g.episodes[0].token_ids = [1] * 12
    sink.put(g)
    assert len(g.episodes) == 1 and lis.events == [("accepted", 1, 1)]


def test_sweep_drops_stale_before_every_cut():
    lis = RecordingListener()
    sink = make(lis, k=1, unused="retry")
    for gid, d in [(0, 0), (1, 1), (2, 2)]:
        sink.put(group(gid, d=d))
    batch = get(sink, step=2)  # group 0 has staleness 2 > K=1
    assert [g.group_id for g in batch] == [1, 2]
    assert ("dropped", 0, "stale", True, True) in lis.events
    assert lis.events[-1] == ("trained", 2, [1, 2])


def test_batch_waits_until_enough_shippable_groups():
    sink = make(k=0)
    sink.put(group(0, d=0))
    sink.put(group(1, d=1))
    with pytest.raises(TimeoutError):
        get(sink, step=1)  # only group 1 can ship at step 1
    assert sink.num_buffered_groups == 1


def test_fifo_takes_oldest_arrivals():
    sink = make(batch_groups=2, k=5)
    for gid in (3, 1, 2):
        sink.put(group(gid))
    assert [g.group_id for g in get(sink, 0)] == [3, 1]


def test_windowed_fifo_follows_dispatch_order_within_window():
    sink = make(batch_groups=2, k=5, order="windowed_fifo", window_fraction=0.5)  # window = 1 group
    groups = [group(i) for i in range(5)]
    for g in groups:
        sink.on_dispatch(g)
    sink.put(groups[2])
    sink.put(groups[3])
    with pytest.raises(TimeoutError):
        get(sink, 0)  # window = first 3 in dispatch order; only group 2 of them finished
    sink.put(groups[1])
    assert [g.group_id for g in get(sink, 0)] == [1, 2]  # dispatch order, group 0 skipped (window)
    sink.on_discard(groups[0])  # cancelled in flight: it no longer holds the window
    sink.put(groups[4])
    assert [g.group_id for g in get(sink, 1)] == [3, 4]


def test_too_many_drops_between_cuts_fail_the_run():
    sink = make(max_dropped=2)
    sink.put(group(0, status="aborted"))
    sink.put(group(1, status="error"))
    with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 2"):
        sink.put(group(2, status="error"))


def test_drop_counter_resets_at_each_cut():
    sink = make(max_dropped=1, batch_groups=1)
    sink.put(group(0, status="error"))
    sink.put(group(1))
    get(sink, 0)
    sink.put(group(2, status="error"))  # one drop since the last cut: allowed


class MySink(TrainSink):
    pass


def test_import_path_selects_replacement():
    sink = build_train_sink(
        cfg=SinkConfig(import_path=f"{__name__}:MySink"),
        batch_groups=1,
        max_off_policy_steps=1,
        seq_len=8,
        unused_handler="drop",
        max_dropped_groups_per_step=1,
        listener=RecordingListener(),
    )
    assert type(sink) is MySink
    with pytest.raises(ValueError, match="module:Class"):
        build_train_sink(cfg=SinkConfig(import_path="nocolon"), listener=None)
