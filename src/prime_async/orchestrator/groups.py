"""The group table: the one place that holds where every dispatched group is.

    dispatch ─► inflight ──accept──► buffered ──take(step)──► trained
                  │  │                   └──drop("stale")──► dropped_stale
                  │  └──drop("errored" | "filtered")──► errored | filtered
                  └──cancel_unshippable──► cancelled

Who calls it: the dispatcher (`dispatch`, `episode_done`, `finish`), the sink (`accept`, `drop`, `take`,
and the groups it chooses from), the weight watcher (`cancel_unshippable`, `wait_idle`), admission (the
counts of its rule) and the main loop (`check`, `metrics`, `pending_groups` for checkpoints).
No other component stores the state of a group.

Counting unit: trajectories (the `ledger/*` metrics). A group enters with `group_size` (one per verifiers
episode); `finish` sets the number it came back with (a multi-agent env trains several per episode),
growing `dispatched` by the difference. Episodes the sink removes before `accept` end as filtered.

Invariants:
- a live group is one record in exactly one of `inflight` (dispatch order) and `buffered` (arrival
  order); a move pops it from one and puts it into the other or folds its trajectories into exactly one
  ended count, so every dispatched trajectory is in exactly one state and `check` finds
  `dispatched == sum of all states`;
- a move out of a state the group is not in raises RuntimeError and changes nothing;
- `changed` is set by every move that can free capacity (admission shares the event for its own inputs),
  `returned` whenever a group leaves inflight (what a waiting `get_batch` re-checks on);
- every group that ends untrained (cancelled, stale, errored, filtered) is reported once to the prompt
  source (`data.unused_group`; the env mix gives its schedule slot back); its prompt goes back to the
  data source of its environment (`retry=True`) when `retry_unused`, unless it was filtered;
- `take(groups, step)` sets `next_batch_step = step + 1` and cancels the in-flight groups that can no
  longer ship in the same synchronous block, so admission never sees the freed space before the new step;
- more than `max_dropped_groups_per_step` drops between two cuts raise RuntimeError (after the move);
- tokens (`ledger/tokens/*`): every loss token of a finished group is generated once and ends in exactly
  one of trained, masked_stale (older than K at its cut, `token_staleness.py`), dropped_stale, filtered
  (removed episodes or truncation before accept), errored, cancelled (the finished episodes of a cancelled
  group), or is still buffered; `check` verifies the sum. What a cancelled group's running episodes had
  sampled is not in the token ledger (the length bias counts it);
- `token_rule = True` (`sink.stragglers = "partial"`): an in-flight group can always still ship (its
  next tokens are sampled under newer weights), so `cancel_unshippable` cancels nothing; the token rule
  is applied at the cut instead, and a group dropped stale (none of its tokens young enough) has its
  prompt retried like a cancelled one.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from prime_async.orchestrator.shipping import lands_in
from prime_async.orchestrator.token_staleness import loss_tokens
from prime_async.orchestrator.types import Group

State = Literal["inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled"]
STATES: tuple[State, ...] = get_args(State)
DropReason = Literal["stale", "filtered", "errored"]
_DROPPED: dict[str, State] = {"stale": "dropped_stale", "filtered": "filtered", "errored": "errored"}
TOKEN_STATES = ("trained", "masked_stale", "dropped_stale", "filtered", "errored", "cancelled")


class PromptReturns(Protocol):
    """Told of every group that ends untrained (`EnvMix`, or a `DataSource` for one environment);
    `retry`: its prompt goes back to be issued again."""

    def unused_group(self, group: Group, *, retry: bool) -> None: ...


@dataclass(eq=False)
class _Live:
    group: Group
    trajectories: int
    unfinished: int
    task: asyncio.Task | None = None
    tokens: int = 0  # loss tokens, set when the group finished


class GroupTable:
    """Every live group by state, the ended ones as counts, and the position of the next batch."""

    def __init__(
        self,
        *,
        group_size: int,
        batch_groups: int,
        max_off_policy_steps: int,
        data: PromptReturns,
        retry_unused: bool,
        max_dropped_groups_per_step: int,
        next_batch_step: int = 0,
        retry_cancelled: bool = True,
        token_rule: bool = False,
    ):
        self.group_size = group_size
        self.batch_groups = batch_groups
        self.max_off_policy_steps = max_off_policy_steps
        self.data = data
        self.retry_unused = retry_unused
        self.retry_cancelled = retry_cancelled
        self.token_rule = token_rule
        self.max_dropped_groups_per_step = max_dropped_groups_per_step
        self.next_batch_step = next_batch_step
        self.dispatched = 0
        self.running_episodes = 0
        self._inflight: dict[int, _Live] = {}
        self._buffered: dict[int, _Live] = {}
        self._ended: dict[State, int] = dict.fromkeys(STATES[2:], 0)
        self.changed = asyncio.Event()
        self.returned = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._dropped_since_cut = 0
        self._prompts_lost = 0
        self._window: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    # -- moves -----------------------------------------------------------------------------------------
    def dispatch(self, group: Group, task: asyncio.Task | None = None) -> None:
        """A new group is in flight with `group_size` running episodes (`task` runs them)."""
        gid = group.group_id
        if gid in self._inflight or gid in self._buffered:
            raise RuntimeError(f"group {gid} dispatched twice")
        self._inflight[gid] = _Live(group, self.group_size, self.group_size, task)
        self.dispatched += self.group_size
        self.running_episodes += self.group_size
        self._idle.clear()

    def episode_done(self, group: Group) -> bool:
        """One episode of `group` finished; False (nothing counted) when the group was cancelled."""
        live = self._inflight.get(group.group_id)
        if live is None:
            return False
        if live.unfinished == 0:
            raise RuntimeError(f"group {group.group_id}: more episodes finished than it has")
        live.unfinished -= 1
        self.running_episodes -= 1
        self.changed.set()
        return True

    def finish(self, group: Group) -> None:
        """Every episode of `group` returned; `group.episodes` holds all its trajectories."""
        live = self._live(group, "inflight", "finish")
        if live.unfinished or len(group.episodes) < self.group_size:
            raise RuntimeError(
                f"group {group.group_id} finished with {live.unfinished} episodes running and "
                f"{len(group.episodes)} trajectories (at least {self.group_size} expected)"
            )
        self.dispatched += len(group.episodes) - live.trajectories
        live.trajectories = len(group.episodes)
        live.tokens = loss_tokens(group)
        self._tokens["generated"] += live.tokens

    def accept(self, group: Group) -> None:
        """inflight -> buffered; trajectories the sink removed from `group.episodes` end as filtered."""
        live = self._live(group, "inflight", "accept")
        if not 0 < len(group.episodes) <= live.trajectories:
            raise RuntimeError(f"group {group.group_id} accepted with {len(group.episodes)} of "
                               f"{live.trajectories} trajectories")  # fmt: skip
        del self._inflight[group.group_id]
        self._ended["filtered"] += live.trajectories - len(group.episodes)
        live.trajectories = len(group.episodes)
        kept = loss_tokens(group)
        self._tokens["filtered"] += live.tokens - kept
        live.tokens = kept
        self._buffered[group.group_id] = live
        self._left_inflight()

    def drop(self, group: Group, reason: DropReason) -> None:
        """inflight or buffered -> dropped_stale | filtered | errored (the retry rule applies)."""
        gid = group.group_id
        source = self._inflight if gid in self._inflight else self._buffered
        live = source.get(gid)
        if live is None or live.group is not group:
            raise RuntimeError(f"cannot drop group {gid}: it is neither in flight nor buffered")
        del source[gid]
        self._ended[_DROPPED[reason]] += live.trajectories
        self._tokens[_DROPPED[reason]] += live.tokens
        self._window[f"dropped_{reason}"] += 1
        if reason == "filtered":
            self.data.unused_group(group, retry=False)  # its content was judged: never retried, not lost
        elif reason == "stale" and self.token_rule:  # a straggler: like a cancel, never selected against
            self._return_prompt(group, retry=self.retry_cancelled or self.retry_unused)
        else:
            self._unused(group, retry=True)
        if source is self._inflight:
            self._left_inflight()
        self.changed.set()
        self._dropped_since_cut += 1
        if self._dropped_since_cut > self.max_dropped_groups_per_step:
            hint = "episodes fail faster than training uses them (the most frequent error follows)"
            raise RuntimeError(
                f"{self._dropped_since_cut} groups dropped since the last batch cut (> "
                f"max_dropped_groups_per_step = {self.max_dropped_groups_per_step}; last reason: {reason}): "
                + (hint if reason == "errored" else "generation is wasted faster than training uses it; "
                   "check rewards/filters, raise max_off_policy_steps or lower max_buffered_groups")
            )  # fmt: skip

    def cancel_unshippable(self) -> list[int]:
        """inflight -> cancelled for every group that can no longer ship; their tasks are cancelled."""
        doomed = [gid for gid, g in self._inflight.items() if not self.can_ship(g.group.dispatch_version)]
        for gid in doomed:
            live = self._inflight.pop(gid)
            if live.task is not None:
                live.task.cancel()
            self._ended["cancelled"] += live.trajectories
            finished = live.group.finished_by_index.values()
            done = sum(ep.num_completion_tokens for eps in finished for ep in eps)
            self._tokens["generated"] += done
            self._tokens["cancelled"] += done
            self.running_episodes -= live.unfinished
            self._window["cancelled"] += 1
            self._return_prompt(live.group, retry=self.retry_cancelled or self.retry_unused)
            self._left_inflight()
        return doomed

    def take(self, groups: list[Group], step: int) -> None:
        """buffered -> trained: batch `step` was cut from `groups`."""
        for group in groups:
            self._live(group, "buffered", "take")
        for group in groups:
            live = self._buffered.pop(group.group_id)
            self._ended["trained"] += live.trajectories
            trained = loss_tokens(group)  # the sink masked what is older than K (token rule)
            self._tokens["trained"] += trained
            self._tokens["masked_stale"] += live.tokens - trained
        self.next_batch_step = step + 1
        self._dropped_since_cut = 0
        self.changed.set()
        self.cancel_unshippable()  # the cut made them unshippable: stop wasting compute

    # -- reads -----------------------------------------------------------------------------------------
    @property
    def num_inflight_groups(self) -> int:
        return len(self._inflight)

    @property
    def num_buffered_groups(self) -> int:
        return len(self._buffered)

    def can_ship(self, dispatch_version: int) -> bool:
        """Whether a group dispatched at `dispatch_version` may still be trained in some future batch
        (always under the token rule: its next tokens are sampled under newer weights)."""
        return self.token_rule or self.next_batch_step - dispatch_version <= self.max_off_policy_steps

    def deadline(self, group: Group) -> int:
        """The last batch `group` can be trained in."""
        return self.deadline_of(group.dispatch_version)

    def deadline_of(self, dispatch_version: int) -> int:
        """The last batch a group dispatched at `dispatch_version` can be trained in."""
        return dispatch_version + self.max_off_policy_steps

    def landing_batch(self) -> int:
        """The batch a group admitted now ships in at the latest (live groups ship by earliest deadline)."""
        live = len(self._inflight) + len(self._buffered)
        return lands_in(self.next_batch_step, live, self.batch_groups)

    def is_inflight(self, group_id: int) -> bool:
        return group_id in self._inflight

    def inflight(self) -> list[Group]:
        """In-flight groups, in dispatch order."""
        return [live.group for live in self._inflight.values()]

    def buffered(self) -> list[Group]:
        """Buffered groups (finished, not trained), oldest arrival first."""
        return [live.group for live in self._buffered.values()]

    def in_dispatch_order(self) -> Iterator[tuple[Group, bool]]:
        """Live groups in dispatch order, each with whether it is buffered (False: still in flight)."""
        for gid in heapq.merge(self._inflight, sorted(self._buffered)):
            live = self._buffered.get(gid)
            yield (live.group, True) if live is not None else (self._inflight[gid].group, False)

    def tasks(self) -> list[asyncio.Task]:
        return [live.task for live in self._inflight.values() if live.task is not None]

    def pending_groups(self) -> list[Group]:
        """Groups issued but not trained: buffered first, then in flight."""
        return self.buffered() + self.inflight()

    def pending_examples(self) -> list[tuple[int, int]]:
        """`(example_id, epoch)` of the prompts issued but not trained: buffered first, then in flight."""
        return [(g.example_id, g.epoch) for g in self.pending_groups()]

    async def wait_idle(self) -> None:
        """Return once no group is in flight."""
        await self._idle.wait()

    def counts(self) -> dict[State, int]:
        """Trajectories per state; they add up to `dispatched`."""
        live = {
            "inflight": sum(live.trajectories for live in self._inflight.values()),
            "buffered": sum(live.trajectories for live in self._buffered.values()),
        }
        return {**live, **self._ended}  # type: ignore[return-value]

    def check(self) -> None:
        """Raise RuntimeError unless the states add up and every record agrees with its group."""
        counts = self.counts()
        if sum(counts.values()) != self.dispatched:
            raise RuntimeError(f"episode ledger unbalanced: dispatched {self.dispatched} != {counts}")
        running = sum(live.unfinished for live in self._inflight.values())
        changed = [gid for gid, b in self._buffered.items() if b.trajectories != len(b.group.episodes)]
        if running != self.running_episodes or changed or self._inflight.keys() & self._buffered.keys():
            raise RuntimeError(
                f"group table inconsistent: running episodes {self.running_episodes} != {running}, "
                f"buffered groups whose episodes changed after accept: {changed}"
            )
        tokens = self.token_counts()
        if tokens["generated"] != sum(n for state, n in tokens.items() if state != "generated"):
            raise RuntimeError(f"token ledger unbalanced: {tokens}")

    def token_counts(self) -> dict[str, int]:
        """Loss tokens generated and where they went; the states add up to `generated`."""
        live = sum(live.tokens for live in (*self._inflight.values(), *self._buffered.values()))
        return {"generated": self._tokens["generated"], "buffered": live,
                **{state: self._tokens[state] for state in TOKEN_STATES}}  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """`ledger/*` (cumulative), buffer sizes, drops and cancels since the last call (then reset)."""
        out = {f"ledger/{state}": float(n) for state, n in self.counts().items()}
        out["ledger/dispatched"] = float(self.dispatched)
        out["ledger/prompts_lost"] = float(self._prompts_lost)
        out.update({f"ledger/tokens/{state}": float(n) for state, n in self.token_counts().items()})
        out["rollout/buffer/inflight_groups"] = float(len(self._inflight))
        out["rollout/buffer/size"] = float(len(self._buffered))
        drops = {reason: self._window[f"dropped_{reason}"] for reason in get_args(DropReason)}
        out["rollout/buffer/dropped_groups"] = float(sum(drops.values()))
        out.update({f"rollout/buffer/dropped_{reason}": float(n) for reason, n in drops.items()})
        out["rollout/cancelled_groups"] = float(self._window["cancelled"])
        self._window.clear()
        return out

    # -- internals -------------------------------------------------------------------------------------
    def _live(self, group: Group, state: State, move: str) -> _Live:
        live = (self._inflight if state == "inflight" else self._buffered).get(group.group_id)
        if live is None or live.group is not group:
            raise RuntimeError(f"cannot {move} group {group.group_id}: it is not {state}")
        return live

    def _left_inflight(self) -> None:
        if not self._inflight:
            self._idle.set()
        self.changed.set()
        self.returned.set()

    def _unused(self, group: Group, *, retry: bool) -> None:
        """A stale or errored group: its prompt is retried when `retry_unused`."""
        self._return_prompt(group, retry=retry and self.retry_unused)

    def _return_prompt(self, group: Group, *, retry: bool) -> None:
        """Tell the prompt source; a prompt not retried was issued and never trained (`prompts_lost`)."""
        if not retry:
            self._prompts_lost += 1
        self.data.unused_group(group, retry=retry)
