"""Train sink: what is trained of the finished groups, and in which order.

    dispatcher ──put(group)──► [drop errored/aborted, overlong, filters] ──► groups.accept | groups.drop
    main loop ──get_batch(step)──► sweep buffered vs K ──► choose batch_groups (fifo | windowed fifo)
                                                          ──► groups.take(batch, step)

The groups themselves live in the group table (`groups.py`); the sink holds no group state, it
decides. A replacement is selected with `sink.import_path = "module:Class"`: a class implementing the
`Sink` protocol below, built with the keyword args `cfg, batch_groups, max_off_policy_steps, seq_len,
groups`.

Invariants:
- THE staleness guarantee: `get_batch(step)` sweeps every buffered group before it takes anything, on
  every attempt, and (`stragglers = "wait"`) drops each with `step - dispatch_version > K`, so no returned
  group is ever staler than K (in-flight cancellation only saves compute), or (`"partial"`) masks every
  loss token sampled more than K versions before `step`, so no trained token is;
- the shipping plan (`shipping.py`): a batch takes finished groups earliest deadline (oldest dispatch
  version) first, and the cut waits for a group in flight rather than leave a live group without a batch
  by its deadline, whenever waiting can keep every deadline; with admission's landing rule nothing
  admitted is then cancelled or dropped stale;
- `put` ends every group it is given with exactly one move: accept (into buffered) or drop;
- the retry rule and the dropped-groups limit are the group table's: filtered groups are never
  retried; stale/errored ones are when `unused_handler = "retry"`;
- `stragglers = "partial"` (opt-in; the default is `"wait"`) bounds tokens, not groups
  (`token_staleness.py`): the sweep drops a buffered group only when none of its loss tokens may train in
  batch `step` any more, the cut takes the earliest *effective* deadlines first, waits for a group in flight
  at most `straggler_wait_s` after the batch could be cut, and masks (and counts) every loss token older
  than K before the take; the group left behind keeps generating under the newer weights and lands in a
  later batch. `stragglers = "wait"` is the group rule above: no group with `step - dispatch_version > K` is
  trained, and the cut waits as long as waiting can keep every deadline;
- `deterministic = true` uses `DeterministicSink`: batch n is exactly the groups of its schedule slots
  (`schedule.py`) that the sink accepted, in slot order, cut once every one of them has left flight;
  completion order never matters. A batch whose every group was dropped fails the run (clear error).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
from typing import Any, Protocol

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.schedule import DeterministicSchedule
from prime_async.orchestrator.shipping import feasible
from prime_async.orchestrator.straggler_budget import StragglerBudget
from prime_async.orchestrator.token_staleness import (
    effective_deadline,
    expiring_share,
    loss_tokens,
    mask_stale,
    trainable_tokens,
)
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


class Sink(Protocol):
    """What the dispatcher and the main loop need from a sink.

    `put(group)` gets each finished group (still in flight in `groups`) and must end it with
    `groups.accept(group)` (episodes it removed first count as filtered) or `groups.drop(group, reason)`.
    `get_batch(step)` returns the groups of batch `step`, moved with `groups.take(batch, step)`; it must
    never return a group with `step - dispatch_version > max_off_policy_steps`. `groups.buffered()` and
    `groups.in_dispatch_order()` are the groups to choose from, `groups.returned` is set whenever a
    group leaves flight.
    """

    def put(self, group: Group) -> None: ...

    async def get_batch(self, step: int) -> list[Group]: ...

    def metrics(self) -> dict[str, float]: ...


class TrainSink:
    """Default sink: drop/filter on put, sweep vs K on every cut, FIFO or windowed FIFO."""

    def __init__(
        self,
        *,
        cfg: SinkConfig,
        batch_groups: int,
        max_off_policy_steps: int,
        seq_len: int,
        groups: GroupTable,
    ):
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.max_off_policy_steps = max_off_policy_steps
        self.seq_len = seq_len
        self.groups = groups
        self._window = math.ceil(cfg.window_fraction * batch_groups)
        self.partial = cfg.stragglers == "partial"
        self.budget = StragglerBudget(fixed_s=cfg.straggler_wait_s, discard_budget=cfg.discard_budget)

    # -- interface -------------------------------------------------------------------------------------
    def put(self, group: Group) -> None:
        if any(e.status != "ok" for e in group.episodes):
            self.groups.drop(group, "errored")
            return
        self._apply_overlong(group)
        if not group.episodes or (self.cfg.reject_equal_reward and _no_signal(group)):
            self.groups.drop(group, "filtered")
            return
        self.groups.accept(group)

    async def get_batch(self, step: int) -> list[Group]:
        """Wait until `batch_groups` shippable groups are available for `step`, then take them; under the
        token rule wait at most the straggler budget for a group in flight once a batch could be cut."""
        loop = asyncio.get_running_loop()
        cut_by: float | None = None  # partial: when a batch that leaves a straggler behind is cut anyway
        while True:
            self.sweep(step)
            batch = self._select(step)
            if batch is None and self.partial:
                candidates = self._candidates(step)
                if candidates is None:
                    cut_by = None
                elif cut_by is None:
                    cut_by = loop.time() + self.straggler_budget()
                if candidates is not None and loop.time() >= cut_by - 1e-6:
                    batch = candidates
            if batch is not None:
                self._take(batch, step)
                return batch
            self.groups.returned.clear()
            timeout = None if cut_by is None else max(cut_by - loop.time(), 1e-6)
            with contextlib.suppress(TimeoutError):  # the straggler budget ran out: cut without it
                await asyncio.wait_for(self.groups.returned.wait(), timeout)

    def straggler_budget(self) -> float:
        """Seconds a batch that could be cut waits for a straggler (`straggler_budget.py`)."""
        return self.budget.seconds()

    def metrics(self) -> dict[str, float]:
        """The straggler budget and the discarded share it steers by (token rule only)."""
        return self.budget.metrics() if self.partial else {}

    def _take(self, batch: list[Group], step: int) -> None:
        if self.partial:
            for group in batch:
                mask_stale(group, step, self.max_off_policy_steps)
        self.groups.take(batch, step)
        if self.partial:
            tokens = self.groups.token_counts()
            discarded = tokens["masked_stale"] + tokens["dropped_stale"]
            self.budget.observe(asyncio.get_running_loop().time(), discarded, tokens["generated"])

    # -- internals -------------------------------------------------------------------------------------
    def sweep(self, step: int) -> None:
        """Drop every buffered group that would be staler than K in batch `step` (the guarantee)."""
        for group in self.groups.buffered():
            if group.dispatch_version > step:
                raise RuntimeError(
                    f"invariant violated: group {group.group_id} was dispatched at version "
                    f"{group.dispatch_version}, newer than batch {step} (staleness "
                    f"{step - group.dispatch_version} < 0): the engines serve weights the trainer has not "
                    "produced in this history"
                )
            if self._stale(group, step):
                self.groups.drop(group, "stale")

    def _stale(self, group: Group, step: int) -> bool:
        """Nothing of `group` may train in batch `step`: older than K (group rule), or (token rule) every
        loss token older than K."""
        k = self.max_off_policy_steps
        if not self.partial or not loss_tokens(group):
            return step - group.dispatch_version > k
        return trainable_tokens(group, step, k) == 0

    def _select(self, step: int) -> list[Group] | None:
        """The batch to cut now, or None to wait for a group in flight (see `_keeps_deadlines`)."""
        batch = self._candidates(step)
        if batch is None or self._keeps_deadlines(batch, step):
            return batch
        return None

    def _candidates(self, step: int) -> list[Group] | None:
        return self._fifo(step) if self.cfg.order == "fifo" else self._windowed(step)

    def _fifo(self, step: int) -> list[Group] | None:
        """The `batch_groups` finished groups with the earliest deadlines (oldest dispatch; under the
        token rule the effective deadline, `token_staleness.py`), arrival order among equals."""
        if self.groups.num_buffered_groups < self.batch_groups:
            return None
        k = self.max_off_policy_steps
        if self.partial:
            key = lambda g: (effective_deadline(g, step, k), -expiring_share(g, step, k), g.dispatch_version)  # noqa: E731
        else:
            key = lambda g: g.dispatch_version  # noqa: E731
        return sorted(self.groups.buffered(), key=key)[: self.batch_groups]

    def _windowed(self, step: int) -> list[Group] | None:
        limit = self.batch_groups + self._window
        candidates: list[Group | None] = []
        for group, buffered in self.groups.in_dispatch_order():
            if len(candidates) >= limit:
                break
            if not buffered and step - group.dispatch_version > self.max_off_policy_steps:
                continue  # in flight and can no longer ship: it will be cancelled, never wait for it
            candidates.append(group if buffered else None)
        ready = [g for g in candidates if g is not None]
        return ready[: self.batch_groups] if len(ready) >= self.batch_groups else None

    def _keeps_deadlines(self, batch: list[Group], step: int) -> bool:
        """Whether cutting `batch` leaves every other live group a batch by its deadline (`shipping.py`).

        False only when waiting can help: the best batch of all live groups (earliest deadlines, in
        flight ones included) would keep them all, so a group still in flight is needed now. When even
        that batch cannot, the cut goes ahead (the latest deadlines lose: counted as cancelled or stale).
        """
        order = self.groups.in_dispatch_order()
        live = {g.group_id: self._deadline(g, buffered, step) for g, buffered in order}
        if self.partial:  # a straggler already past its deadline is not waited for: it rides on
            live = {gid: d for gid, d in live.items() if d >= step}
        taken = {g.group_id for g in batch}
        rest = [d for gid, d in live.items() if gid not in taken]
        if feasible(rest, step + 1, self.batch_groups):
            return True
        deadlines = sorted(live.values())
        return not feasible(deadlines[self.batch_groups :], step + 1, self.batch_groups)

    def _deadline(self, group: Group, buffered: bool, step: int) -> int:
        """The group's deadline (the token rule's effective one for a finished group)."""
        if self.partial and buffered:
            return effective_deadline(group, step, self.max_off_policy_steps)
        return self.groups.deadline(group)

    def _apply_overlong(self, group: Group) -> None:
        kept: list[Episode] = []
        for ep in group.episodes:
            # Episodes arrive already clamped to seq_len by the gateway, flagged `overlong`: length alone
            # would never see them.
            if not (ep.overlong or len(ep.token_ids) > self.seq_len):
                kept.append(ep)
            elif self.cfg.overlong == "truncate":
                _truncate(ep, self.seq_len)
                kept.append(ep)
        group.episodes = kept


class DeterministicSink(TrainSink):
    """Batches by dispatch slot (`deterministic = true`); `put` filters like the default sink."""

    def __init__(self, *, schedule: DeterministicSchedule, **kwargs: Any):
        super().__init__(**kwargs)
        self.schedule = schedule
        self.partial = False  # slot by slot, each group whole: the group rule

    async def get_batch(self, step: int) -> list[Group]:
        """Wait until every slot of batch `step` was dispatched and has left flight, then take them."""
        slots = self.schedule.slots(step)
        while not self._complete(step):
            self.groups.returned.clear()
            await self.groups.returned.wait()
        self.sweep(step)
        batch = sorted((g for g in self.groups.buffered() if g.group_id in slots), key=lambda g: g.group_id)
        if not batch:
            raise RuntimeError(
                f"deterministic: every group of batch {step} (slots {slots.start}..{slots.stop - 1}) was "
                "dropped (errored or filtered); a deterministic batch is never refilled from later slots"
            )
        self.groups.take(batch, step)
        return batch

    def _complete(self, step: int) -> bool:
        if not self.schedule.batch_dispatched(step):
            return False
        slots = self.schedule.slots(step)
        return not any(g.group_id in slots for g in self.groups.inflight())


def _no_signal(group: Group) -> bool:
    """True when every seat's rewards are all equal: no episode would get a non-zero advantage."""
    rewards = group.rewards
    return all(len({rewards[i] for i in idx}) <= 1 for idx in group.seats().values())


def _truncate(ep: Episode, seq_len: int) -> None:
    ep.token_ids = ep.token_ids[:seq_len]
    ep.loss_mask = ep.loss_mask[:seq_len]
    ep.sampler_logprobs = ep.sampler_logprobs[:seq_len]
    ep.token_versions = ep.token_versions[:seq_len]
    ep.images = [im for im in ep.images if im.offset + im.length <= seq_len]  # a cut image is left out
    ep.truncated = ep.overlong = True


def build_train_sink(
    *, cfg: SinkConfig, schedule: DeterministicSchedule | None = None, **kwargs: Any
) -> Sink:
    """Build the default sink, the deterministic one (`schedule` given), or the class at
    `cfg.import_path` (`module:Class`) with the same args."""
    if schedule is not None:
        return DeterministicSink(cfg=cfg, schedule=schedule, **kwargs)
    if cfg.import_path is None:
        return TrainSink(cfg=cfg, **kwargs)
    module_name, sep, class_name = cfg.import_path.partition(":")
    if not sep or not class_name:
        raise ValueError(f"sink.import_path = {cfg.import_path!r}: expected 'module:Class'")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(cfg=cfg, **kwargs)
