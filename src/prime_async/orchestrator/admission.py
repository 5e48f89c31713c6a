"""Admission control: decides when the dispatcher may create the next group.

A new group is admitted only while all of these hold (checked in this order; the first failing one is
the reported reason):

    hold            no weight update asked admission to stop (drain, in_place cache flush)
    off_policy      next_batch_step - served_version <= K     (never create a group that cannot ship)
    buffer_full     groups_not_returned + buffered_groups + 1 <= max_buffered_groups
    inflight_limit  group granularity:  groups_not_returned + 1 <= max_inflight_groups
                    sample granularity: running_episodes + group_size <= max_inflight_groups * group_size

With `sample` granularity each finished episode frees its own slot; with `group` the slot is held until
the whole group returns (miles' submission granularity). The buffer limit always counts whole groups:
a group with a straggler still holds its place until it reaches the sink.

Callers report every capacity change (`on_*` hooks, `set_served_version`, `on_batch_cut`); each sets
`changed`, so the dispatcher re-checks exactly when capacity may have freed.

Wait accounting: the time admission spent blocked by each reason, as a fraction of the step window
(the time between two batch cuts), for `rollout/buffer/admission_wait_*`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

logger = logging.getLogger(__name__)

Granularity = Literal["sample", "group"]
BlockReason = Literal["hold", "off_policy", "buffer_full", "inflight_limit"]
_REASONS: tuple[BlockReason, ...] = ("hold", "off_policy", "buffer_full", "inflight_limit")


class AdmissionController:
    """Both caps + the K rule; counts running episodes and groups not yet returned."""

    def __init__(
        self,
        *,
        max_inflight_groups: int,
        max_buffered_groups: int,
        max_off_policy_steps: int,
        group_size: int,
        granularity: Granularity,
        buffered_groups: Callable[[], int],
        served_version: int = 0,
        next_batch_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_inflight_groups = max_inflight_groups
        self.max_buffered_groups = max_buffered_groups
        self.max_off_policy_steps = max_off_policy_steps
        self.group_size = group_size
        self.granularity = granularity
        self._buffered_groups = buffered_groups
        self.served_version = served_version
        self.next_batch_step = next_batch_step
        self.clock = clock
        self.running_episodes = 0
        self.groups_not_returned = 0
        self._holds = 0
        self.changed = asyncio.Event()
        self._blocked: BlockReason | None = None
        self._blocked_since = 0.0
        self._window_start = clock()
        self._wait: dict[str, float] = dict.fromkeys(_REASONS, 0.0)

    # -- the rule -------------------------------------------------------------------------------------
    def blocked_reason(self) -> BlockReason | None:
        if self._holds > 0:
            return "hold"
        if self.next_batch_step - self.served_version > self.max_off_policy_steps:
            return "off_policy"
        if self.groups_not_returned + self._buffered_groups() + 1 > self.max_buffered_groups:
            return "buffer_full"
        if self.granularity == "group":
            if self.groups_not_returned + 1 > self.max_inflight_groups:
                return "inflight_limit"
        elif self.running_episodes + self.group_size > self.max_inflight_groups * self.group_size:
            return "inflight_limit"
        return None

    def poll(self) -> BlockReason | None:
        """Evaluate the rule now and account the blocked time; None means a group may be admitted."""
        reason = self.blocked_reason()
        if reason != self._blocked:
            now = self.clock()
            if self._blocked is not None:
                self._wait[self._blocked] += now - self._blocked_since
            self._blocked, self._blocked_since = reason, now
        return reason

    # -- capacity changes ------------------------------------------------------------------------------
    def notify(self) -> None:
        self.changed.set()

    def on_group_dispatched(self) -> None:
        self.groups_not_returned += 1
        self.running_episodes += self.group_size

    def on_episodes_finished(self, n: int = 1) -> None:
        self.running_episodes -= n
        assert self.running_episodes >= 0, "admission: more episodes finished than dispatched"
        self.notify()

    def on_group_returned(self) -> None:
        self.groups_not_returned -= 1
        assert self.groups_not_returned >= 0, "admission: more groups returned than dispatched"
        self.notify()

    def on_batch_cut(self, step: int) -> None:
        self.next_batch_step = step + 1
        self.notify()

    def set_served_version(self, version: int) -> None:
        self.served_version = version
        self.notify()

    def hold(self) -> None:
        self._holds += 1
        self.notify()

    def release(self) -> None:
        assert self._holds > 0, "admission: release without hold"
        self._holds -= 1
        self.notify()

    def can_ship(self, dispatch_version: int) -> bool:
        """Whether a group dispatched at `dispatch_version` may still be trained in some future batch."""
        return self.next_batch_step - dispatch_version <= self.max_off_policy_steps

    # -- metrics ---------------------------------------------------------------------------------------
    def window_metrics(self) -> dict[str, float]:
        """Blocked fractions of the window since the last call; starts a new window."""
        now = self.clock()
        if self._blocked is not None:
            self._wait[self._blocked] += now - self._blocked_since
            self._blocked_since = now
        span = max(now - self._window_start, 1e-9)
        out = {f"rollout/buffer/admission_wait_{r}": self._wait[r] / span for r in _REASONS}
        self._wait = dict.fromkeys(_REASONS, 0.0)
        self._window_start = now
        return out
