"""Admission control: decides when the dispatcher may create the next group.

A new group is admitted only while all of these hold (checked in this order; the first failing one is
the reported reason):

    hold            no weight update asked admission to stop (drain, in_place cache flush)
    off_policy      landing_batch - served_version <= K       (never create a group that cannot ship):
                    landing_batch = next_batch_step + live_groups // batch_groups is the batch the new
                    group ships in at the latest when live groups ship earliest deadline first
                    (`shipping.py`: with the sink's cut rule, no admitted group is cancelled or stale);
                    with a deterministic schedule (`schedule.py`) also: the next slot's version is served
    buffer_full     inflight_groups + buffered_groups + 1 <= max_buffered_groups
    inflight_limit  group granularity:  inflight_groups + 1 <= max_inflight_groups
                    sample granularity: running_episodes + group_size <= max_inflight_groups * group_size

With `sample` granularity each finished episode frees its own slot; with `group` the slot is held until
the whole group returns (miles' submission granularity). The buffer limit always counts whole groups:
a group with a straggler still holds its place until it reaches the sink.

Every count and `next_batch_step` is read from the group table (`groups.py`), which sets its `changed`
event on every move that can free capacity; admission sets the same event when its own inputs change
(`set_served_version`, `hold`, `release`), so the dispatcher re-checks exactly when capacity may have freed.

Wait accounting: the time admission spent blocked by each reason, as a fraction of the step window
(the time between two batch cuts), for `rollout/buffer/admission_wait_*`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.schedule import DeterministicSchedule

Granularity = Literal["sample", "group"]
BlockReason = Literal["hold", "off_policy", "buffer_full", "inflight_limit"]
_REASONS: tuple[BlockReason, ...] = ("hold", "off_policy", "buffer_full", "inflight_limit")


class AdmissionController:
    """Both caps + the K rule over the counts of the group table; holds and the served version."""

    def __init__(
        self,
        *,
        groups: GroupTable,
        max_inflight_groups: int,
        max_buffered_groups: int,
        granularity: Granularity,
        served_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        schedule: DeterministicSchedule | None = None,
    ):
        self.groups = groups
        self.schedule = schedule
        self.max_inflight_groups = max_inflight_groups
        self.max_buffered_groups = max_buffered_groups
        self.granularity = granularity
        self.served_version = served_version
        self.clock = clock
        self._holds = 0
        self.changed = groups.changed
        self._blocked: BlockReason | None = None
        self._blocked_since = 0.0
        self._window_start = clock()
        self._wait: dict[str, float] = dict.fromkeys(_REASONS, 0.0)

    # -- the rule -------------------------------------------------------------------------------------
    def blocked_reason(self) -> BlockReason | None:
        groups = self.groups
        if self._holds > 0:
            return "hold"
        if groups.landing_batch() - self.served_version > groups.max_off_policy_steps:
            return "off_policy"
        if self.schedule is not None and self.schedule.blocked(self.served_version):
            return "off_policy"
        if groups.num_inflight_groups + groups.num_buffered_groups + 1 > self.max_buffered_groups:
            return "buffer_full"
        if self.granularity == "group":
            if groups.num_inflight_groups + 1 > self.max_inflight_groups:
                return "inflight_limit"
        elif groups.running_episodes + groups.group_size > self.max_inflight_groups * groups.group_size:
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

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
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
