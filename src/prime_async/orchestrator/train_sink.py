"""Train sink: what is trained of the finished groups, and in which order.

    dispatcher ──put(group)──► [drop errored/aborted, overlong, filters] ──► groups.accept | groups.drop
    main loop ──get_batch(step)──► sweep buffered vs K ──► choose batch_groups (fifo | windowed fifo)
                                                          ──► groups.take(batch, step)

The groups themselves live in the group table (`groups.py`); the sink holds no group state, it
decides. A replacement is selected with `sink.import_path = "module:Class"`: a class implementing the
`Sink` protocol below, built with the keyword args `cfg, batch_groups, max_off_policy_steps, seq_len,
groups`.

Invariants:
- THE staleness guarantee: `get_batch(step)` sweeps every buffered group and drops each with
  `step - dispatch_version > K` before it takes anything, on every attempt, so no returned group is
  ever staler than K (in-flight cancellation only saves compute);
- the shipping plan (`shipping.py`): a batch takes finished groups earliest deadline (oldest dispatch
  version) first, and the cut waits for a group in flight rather than leave a live group without a batch
  by its deadline, whenever waiting can keep every deadline; with admission's landing rule nothing
  admitted is then cancelled or dropped stale;
- `put` ends every group it is given with exactly one move: accept (into buffered) or drop;
- the retry rule and the dropped-groups limit are the group table's: filtered groups are never
  retried; stale/errored ones are when `unused_handler = "retry"`;
- `deterministic = true` uses `DeterministicSink`: batch n is exactly the groups of its schedule slots
  (`schedule.py`) that the sink accepted, in slot order, cut once every one of them has left flight;
  completion order never matters. A batch whose every group was dropped fails the run (clear error).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Protocol

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.schedule import DeterministicSchedule
from prime_async.orchestrator.shipping import feasible
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
        """Wait until `batch_groups` shippable groups are available for `step`, then take them."""
        while True:
            self.sweep(step)
            batch = self._select(step)
            if batch is not None:
                self.groups.take(batch, step)
                return batch
            self.groups.returned.clear()
            await self.groups.returned.wait()

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
            if step - group.dispatch_version > self.max_off_policy_steps:
                self.groups.drop(group, "stale")

    def _select(self, step: int) -> list[Group] | None:
        """The batch to cut now, or None to wait for a group in flight (see `_keeps_deadlines`)."""
        batch = self._fifo(step) if self.cfg.order == "fifo" else self._windowed(step)
        if batch is None or self._keeps_deadlines(batch, step):
            return batch
        return None

    def _fifo(self, step: int) -> list[Group] | None:
        """The `batch_groups` finished groups with the earliest deadlines (oldest dispatch), arrival order
        among equals."""
        if self.groups.num_buffered_groups < self.batch_groups:
            return None
        by_deadline = sorted(self.groups.buffered(), key=lambda g: g.dispatch_version)
        return by_deadline[: self.batch_groups]

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
        live = [group for group, _ in self.groups.in_dispatch_order()]
        taken = {g.group_id for g in batch}
        rest = [self.groups.deadline(g) for g in live if g.group_id not in taken]
        if feasible(rest, step + 1, self.batch_groups):
            return True
        deadlines = sorted(self.groups.deadline(g) for g in live)
        return not feasible(deadlines[self.batch_groups :], step + 1, self.batch_groups)

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
