"""Train sink: the store of finished groups between dispatch and the trainer.

    dispatcher ──put(group)──► [drop errored/aborted, overlong, filters] ──► queue
    main loop ──get_batch(step)──► sweep queue vs K ──► take batch_groups (fifo | windowed fifo)

Interface (miles' data buffer): `put(group)`, `await get_batch(step) -> list[Group]`, `get_metrics()`;
optional hooks `on_dispatch(group)` / `on_discard(group)` keep the generation order for windowed FIFO.
A replacement is selected with `sink.import_path = "module:Class"` and built with the same keyword args.

Invariants:
- THE staleness guarantee: `get_batch(step)` sweeps the whole queue and drops every group with
  `step - dispatch_version > K` before it takes anything, on every attempt, so no returned group is
  ever staler than K (in-flight cancellation only saves compute);
- a group leaves the queue exactly once, as trained or dropped, and each move is reported to the
  `SinkListener` (ledger, admission, retry of the prompt);
- filtered groups are never retried; stale/errored ones are retried when `unused_handler = "retry"`;
- more than `max_dropped_groups_per_step` drops between two batch cuts raises RuntimeError.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
from collections import Counter
from typing import Any, Literal, Protocol

from prime_async.config.orchestrator import SinkConfig
from prime_async.orchestrator.types import Episode, Group

logger = logging.getLogger(__name__)

DropReason = Literal["stale", "filtered", "errored"]


class SinkListener(Protocol):
    """Receives every move of a group through the sink (implemented by the dispatcher)."""

    def on_accepted(self, group: Group, *, num_filtered_episodes: int) -> None: ...

    def on_dropped(self, group: Group, *, reason: DropReason, retry: bool, from_queue: bool) -> None: ...

    def on_trained(self, groups: list[Group], *, step: int) -> None: ...


class TrainSink:
    """Default sink: drop/filter on put, sweep vs K on every cut, FIFO or windowed FIFO."""

    def __init__(
        self,
        *,
        cfg: SinkConfig,
        batch_groups: int,
        max_off_policy_steps: int,
        seq_len: int,
        unused_handler: Literal["drop", "retry"],
        max_dropped_groups_per_step: int,
        listener: SinkListener,
    ):
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.max_off_policy_steps = max_off_policy_steps
        self.seq_len = seq_len
        self.unused_handler = unused_handler
        self.max_dropped_groups_per_step = max_dropped_groups_per_step
        self.listener = listener
        self._queue: list[Group] = []  # arrival order
        # dispatch order: group_id -> (dispatch_version, group once put, None while in flight)
        self._generation: dict[int, tuple[int, Group | None]] = {}
        self._arrived = asyncio.Event()
        self._dropped_since_cut = 0
        self._drops: Counter[str] = Counter()
        self._window = math.ceil(cfg.window_fraction * batch_groups)

    # -- interface -------------------------------------------------------------------------------------
    @property
    def num_buffered_groups(self) -> int:
        return len(self._queue)

    @property
    def num_buffered_episodes(self) -> int:
        return sum(len(g.episodes) for g in self._queue)

    def on_dispatch(self, group: Group) -> None:
        self._generation[group.group_id] = (group.dispatch_version, None)

    def on_discard(self, group: Group) -> None:
        """A dispatched group will never be put (cancelled in flight)."""
        self._generation.pop(group.group_id, None)
        self._arrived.set()

    def put(self, group: Group) -> None:
        if any(e.status != "ok" for e in group.episodes):
            self._drop(group, "errored", from_queue=False)
            return
        num_filtered = self._apply_overlong(group)
        if not group.episodes:
            self._drop(group, "filtered", from_queue=False)
            return
        if self.cfg.reject_equal_reward and len(set(group.rewards)) <= 1:
            self._drop(group, "filtered", from_queue=False)
            return
        self._queue.append(group)
        self._generation[group.group_id] = (group.dispatch_version, group)
        self.listener.on_accepted(group, num_filtered_episodes=num_filtered)
        self._arrived.set()

    async def get_batch(self, step: int) -> list[Group]:
        """Wait until `batch_groups` shippable groups are available for `step`, then take them."""
        while True:
            self.sweep(step)
            batch = self._select(step)
            if batch is not None:
                taken = {g.group_id for g in batch}
                self._queue = [g for g in self._queue if g.group_id not in taken]
                for gid in taken:
                    self._generation.pop(gid, None)
                self._dropped_since_cut = 0
                self.listener.on_trained(batch, step=step)
                return batch
            self._arrived.clear()
            await self._arrived.wait()

    def get_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "rollout/buffer/size": float(len(self._queue)),
            "rollout/buffer/dropped_groups": float(sum(self._drops.values())),
        }
        for reason in ("stale", "filtered", "errored"):
            out[f"rollout/buffer/dropped_{reason}"] = float(self._drops[reason])
        self._drops.clear()
        return out

    def pending_examples(self) -> list[tuple[int, int]]:
        """`(example_id, epoch)` of groups in the queue (finished, not trained), oldest first."""
        return [(g.example_id, g.epoch) for g in self._queue]

    # -- internals -------------------------------------------------------------------------------------
    def sweep(self, step: int) -> None:
        """Drop every queued group that would be staler than K in batch `step` (the guarantee)."""
        keep: list[Group] = []
        for group in self._queue:
            if step - group.dispatch_version > self.max_off_policy_steps:
                self._drop(group, "stale", from_queue=True)
            else:
                keep.append(group)
        self._queue = keep

    def _select(self, step: int) -> list[Group] | None:
        if self.cfg.order == "fifo":
            if len(self._queue) < self.batch_groups:
                return None
            return self._queue[: self.batch_groups]
        limit = self.batch_groups + self._window
        candidates: list[Group | None] = []
        for version, group in self._generation.values():
            if len(candidates) >= limit:
                break
            if group is None and step - version > self.max_off_policy_steps:
                continue  # in flight and can no longer ship: it will be cancelled, never wait for it
            candidates.append(group)
        ready = [g for g in candidates if g is not None]
        return ready[: self.batch_groups] if len(ready) >= self.batch_groups else None

    def _apply_overlong(self, group: Group) -> int:
        kept: list[Episode] = []
        num_filtered = 0
        for ep in group.episodes:
            if len(ep.token_ids) <= self.seq_len:
                kept.append(ep)
            elif self.cfg.overlong == "truncate":
                _truncate(ep, self.seq_len)
                kept.append(ep)
            else:
                num_filtered += 1
        group.episodes = kept
        return num_filtered

    def _drop(self, group: Group, reason: DropReason, *, from_queue: bool) -> None:
        self._generation.pop(group.group_id, None)
        self._drops[reason] += 1
        self._dropped_since_cut += 1
        retry = self.unused_handler == "retry" and reason != "filtered"
        self.listener.on_dropped(group, reason=reason, retry=retry, from_queue=from_queue)
        if self._dropped_since_cut > self.max_dropped_groups_per_step:
            raise RuntimeError(
                f"{self._dropped_since_cut} groups dropped since the last batch cut (> "
                f"max_dropped_groups_per_step = {self.max_dropped_groups_per_step}; last reason: {reason}): "
                "generation is wasted faster than training uses it; check rewards/filters, raise "
                "max_off_policy_steps or lower max_buffered_groups"
            )


def _truncate(ep: Episode, seq_len: int) -> None:
    ep.token_ids = ep.token_ids[:seq_len]
    ep.loss_mask = ep.loss_mask[:seq_len]
    ep.sampler_logprobs = ep.sampler_logprobs[:seq_len]
    ep.token_versions = ep.token_versions[:seq_len]
    ep.truncated = True


def build_train_sink(*, cfg: SinkConfig, **kwargs: Any) -> TrainSink:
    """Build the default sink, or the class at `cfg.import_path` (`module:Class`) with the same args."""
    if cfg.import_path is None:
        return TrainSink(cfg=cfg, **kwargs)
    module_name, sep, class_name = cfg.import_path.partition(":")
    if not sep or not class_name:
        raise ValueError(f"sink.import_path = {cfg.import_path!r}: expected 'module:Class'")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(cfg=cfg, **kwargs)
