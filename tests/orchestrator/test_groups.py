"""GroupTable: the one state table of groups. Moves, counts in trajectories, retry rule, drop limit, the
cut, and (stateful property test) every dispatched trajectory in exactly one state after every move."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import STATES, TOKEN_STATES, GroupTable
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


def make(*, group_size=2, k=1, retry=True, max_dropped=100) -> GroupTable:
    return GroupTable(
        group_size=group_size,
        batch_groups=2,
        max_off_policy_steps=k,
        data=DataSource(num_examples=100, seed=0, shuffle=False),
        retry_unused=retry,
        max_dropped_groups_per_step=max_dropped,
    )


def dispatch(table: GroupTable, gid: int, d: int = 0) -> Group:
    group = Group(group_id=gid, example_id=10 + gid, dispatch_version=d)
    table.dispatch(group)
    return group


def finish(table: GroupTable, group: Group, trajectories: int | None = None) -> None:
    """Every episode of `group` returns, with `trajectories` trajectories in all."""
    for _ in range(table.group_size):
        assert table.episode_done(group)
    n = table.group_size if trajectories is None else trajectories
    group.episodes = [Episode(example_id=group.example_id, reward=float(i)) for i in range(n)]
    table.finish(group)


def test_counts_follow_a_group_in_trajectories_split_and_filtered():
    table = make(group_size=2)
    g0, g1 = dispatch(table, 0), dispatch(table, 1)
    assert table.counts()["inflight"] == 4 and table.running_episodes == 4
    finish(table, g0, trajectories=4)  # a two-seat env: 2 episodes x 2 seats
    g0.episodes = g0.episodes[1:]  # the sink dropped one overlong trajectory, then accepted the group
    table.accept(g0)
    assert table.counts() == {"inflight": 2, "buffered": 3, "trained": 0, "dropped_stale": 0, "filtered": 1,
                              "errored": 0, "cancelled": 0}  # fmt: skip
    assert table.dispatched == 6 and table.buffered() == [g0] and table.inflight() == [g1]
    table.take([g0], step=0)
    assert table.counts()["trained"] == 3 and table.next_batch_step == 1
    table.check()
    m = table.metrics()
    assert {k for k in m if k.startswith("ledger/") and not k.startswith("ledger/tokens/")} == {
        f"ledger/{s}" for s in (*STATES, "dispatched", "prompts_lost")
    }
    assert {k for k in m if k.startswith("ledger/tokens/")} == {
        f"ledger/tokens/{s}" for s in ("generated", "buffered", *TOKEN_STATES)
    }
    assert m["ledger/dispatched"] == sum(m[f"ledger/{s}"] for s in STATES) == 6


def test_a_move_from_the_wrong_state_raises_and_changes_nothing():
    table = make()
    g0, g1 = dispatch(table, 0), dispatch(table, 1)
    finish(table, g0)
    table.accept(g0)
    table.episode_done(g1)
    before = (table.counts(), table.dispatched, table.running_episodes)
    wrong = [
        lambda: table.accept(g0),  # already buffered
        lambda: table.take([g0, g1], step=0),  # g1 is still in flight: nothing of the batch moves
        lambda: table.finish(g1),  # one episode still running
        lambda: table.dispatch(g0),  # dispatched twice
        lambda: table.drop(Group(group_id=0, example_id=0, dispatch_version=0), "stale"),  # another object
        lambda: table.drop(Group(group_id=7, example_id=0, dispatch_version=0), "stale"),  # never dispatched
    ]
    for move in wrong:
        with pytest.raises(RuntimeError):
            move()
        assert (table.counts(), table.dispatched, table.running_episodes) == before
    table.check()


def test_retry_rule_stale_errored_and_cancelled_prompts_return_filtered_never():
    table = make(k=0)
    groups = [dispatch(table, gid) for gid in range(4)]
    for g in groups[:3]:
        finish(table, g)
    table.drop(groups[0], "errored")
    table.drop(groups[1], "filtered")
    table.accept(groups[2])
    table.drop(groups[2], "stale")
    table.take([], step=0)  # next batch 1: group 3 (d = 0, K = 0) can no longer ship
    assert table.counts()["cancelled"] == 2 and table.cancel_unshippable() == []
    assert [table.data.next_example()[0] for _ in range(3)] == [10, 12, 13]  # retried first, oldest first
    m = table.metrics()
    assert (m["rollout/buffer/dropped_groups"], m["rollout/cancelled_groups"]) == (3, 1)
    no_retry = make(retry=False)
    finish(no_retry, g := dispatch(no_retry, 0))
    no_retry.drop(g, "errored")
    assert no_retry.data.num_retry_pending == 0


def test_drop_limit_raises_after_the_move_and_resets_at_each_cut():
    table = make(max_dropped=1)
    for gid in range(3):
        finish(table, dispatch(table, gid))
    table.drop(table.inflight()[0], "errored")
    table.accept(table.inflight()[0])
    table.take(table.buffered(), step=0)  # resets the count
    last = table.inflight()[0]
    table.drop(last, "errored")  # one since the cut: allowed
    finish(table, g := dispatch(table, 3))
    with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 1"):
        table.drop(g, "errored")
    assert table.counts()["errored"] == 6  # the move happened before the raise
    table.check()


def test_cut_cancels_unshippable_groups_and_their_tasks_at_once():
    async def go():
        table = make(k=1)
        tasks = {}
        for gid, d in [(0, 0), (1, 1), (2, 1)]:
            group = Group(group_id=gid, example_id=gid, dispatch_version=d)
            tasks[gid] = asyncio.create_task(asyncio.sleep(100))
            table.dispatch(group, tasks[gid])
        g2 = table.inflight()[2]
        finish(table, g2)
        table.accept(g2)
        table.returned.clear()
        table.take([g2], step=1)  # next batch 2: the group stamped 0 can never ship
        await asyncio.sleep(0)
        assert tasks[0].cancelled() and not tasks[1].done()
        assert [g.group_id for g in table.inflight()] == [1] and table.returned.is_set()
        assert table.running_episodes == 2 and table.counts()["cancelled"] == 2
        assert not table.episode_done(Group(group_id=0, example_id=0, dispatch_version=0))  # counts nowhere
        assert not table.is_inflight(0)
        table.check()
        for task in tasks.values():
            task.cancel()

    asyncio.run(go())


def test_views_dispatch_order_arrival_order_and_pending_prompts():
    table = make()
    groups = [dispatch(table, gid) for gid in range(4)]
    for g in (groups[2], groups[0]):
        finish(table, g)
        table.accept(g)
    assert table.buffered() == [groups[2], groups[0]]  # arrival order
    order = [(g.group_id, buffered) for g, buffered in table.in_dispatch_order()]
    assert order == [(0, True), (1, False), (2, True), (3, False)]
    assert table.pending_examples() == [(12, 0), (10, 0), (11, 0), (13, 0)]  # buffered first


class GroupLifecycle(RuleBasedStateMachine):
    """Random moves, legal and illegal, against a model of where every group is."""

    def __init__(self) -> None:
        super().__init__()
        self.table = make(group_size=2, k=1, max_dropped=10**9)
        self.groups: dict[int, Group] = {}
        self.where: dict[int, str] = {}  # the model: group id -> state
        self.size: dict[int, int] = {}  # trajectories of a group in its state
        self.ended: Counter[str] = Counter()
        self.unfinished: dict[int, int] = {}
        self.version = 0

    def _ids(self, state: str) -> list[int]:
        return sorted(gid for gid, s in self.where.items() if s == state)

    def _end(self, gid: int, state: str, trajectories: int) -> None:
        self.where[gid] = state
        self.ended[state] += trajectories

    @rule()
    def dispatch(self) -> None:
        gid = len(self.groups)
        self.groups[gid] = dispatch(self.table, gid, d=self.version)
        self.where[gid], self.size[gid], self.unfinished[gid] = "inflight", 2, 2

    @precondition(lambda self: any(self.unfinished[g] for g in self._ids("inflight")))
    @rule(data=st.data())
    def one_episode_returns(self, data) -> None:
        gid = data.draw(st.sampled_from([g for g in self._ids("inflight") if self.unfinished[g]]))
        assert self.table.episode_done(self.groups[gid])
        self.unfinished[gid] -= 1

    @precondition(lambda self: self.version < self.table.next_batch_step)
    @rule()
    def new_weights(self) -> None:
        self.version += 1

    @precondition(lambda self: self._ids("inflight"))
    @rule(data=st.data(), extra=st.integers(0, 3), removed=st.integers(0, 5), outcome=st.sampled_from(
        ["accept", "errored", "filtered"]))  # fmt: skip
    def finish(self, data, extra, removed, outcome) -> None:
        gid = data.draw(st.sampled_from(self._ids("inflight")))
        group = self.groups[gid]
        for _ in range(self.unfinished[gid]):
            self.table.episode_done(group)
        group.episodes = [Episode(example_id=gid, reward=float(i)) for i in range(2 + extra)]
        self.table.finish(group)
        self.unfinished[gid] = 0
        if outcome != "accept":
            self.table.drop(group, outcome)
            self._end(gid, outcome, 2 + extra)
            return
        removed = min(removed, 1 + extra)
        group.episodes = group.episodes[removed:]
        self.table.accept(group)
        self.where[gid], self.size[gid] = "buffered", 2 + extra - removed
        self.ended["filtered"] += removed

    @precondition(lambda self: self._ids("buffered"))
    @rule(data=st.data())
    def drop_stale(self, data) -> None:
        gid = data.draw(st.sampled_from(self._ids("buffered")))
        self.table.drop(self.groups[gid], "stale")
        self._end(gid, "dropped_stale", self.size[gid])

    @rule(data=st.data())
    def cut(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(self._ids("buffered")), unique=True)) if self._ids(
            "buffered") else []  # fmt: skip
        step = self.table.next_batch_step
        self.table.take([self.groups[gid] for gid in ids], step)
        for gid in ids:
            self._end(gid, "trained", self.size[gid])
        for gid in self._ids("inflight"):  # the cut cancels what can no longer ship
            if step + 1 - self.groups[gid].dispatch_version > 1:
                self._end(gid, "cancelled", self.size[gid])

    @precondition(lambda self: self.groups)
    @rule(data=st.data(), move=st.sampled_from(["accept", "take", "drop", "finish"]))
    def wrong_move(self, data, move) -> None:
        gid = data.draw(st.sampled_from(sorted(self.groups)))
        state, group = self.where[gid], self.groups[gid]
        legal = {"accept": "inflight", "take": "buffered", "finish": "inflight"}.get(move)
        if legal == state or (move == "drop" and state in ("inflight", "buffered")):
            return  # a legal move: not what this rule tries
        before = (self.table.counts(), self.table.dispatched)
        with pytest.raises(RuntimeError):
            if move == "accept":
                self.table.accept(group)
            elif move == "take":
                self.table.take([group], self.table.next_batch_step)
            elif move == "drop":
                self.table.drop(group, "stale")
            else:
                self.table.finish(group)
        assert (self.table.counts(), self.table.dispatched) == before

    @invariant()
    def every_trajectory_is_in_exactly_one_state(self) -> None:
        counts = self.table.counts()
        inflight = {g.group_id for g in self.table.inflight()}
        buffered = {g.group_id for g in self.table.buffered()}
        assert not inflight & buffered
        assert inflight == set(self._ids("inflight")) and buffered == set(self._ids("buffered"))
        assert counts["inflight"] == sum(self.size[g] for g in inflight)
        assert counts["buffered"] == sum(self.size[g] for g in buffered)
        assert {s: counts[s] for s in STATES[2:]} == {s: self.ended[s] for s in STATES[2:]}
        assert sum(counts.values()) == self.table.dispatched
        assert self.table.running_episodes == sum(self.unfinished[g] for g in inflight)
        self.table.check()


TestGroupLifecycle = GroupLifecycle.TestCase
TestGroupLifecycle.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
