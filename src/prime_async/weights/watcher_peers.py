"""What the weight watcher and its parts (`engine_outage.py`, `update_gates.py`, `inplace_flush.py`) drive
on the orchestrator's side, as protocols (the weights package never imports the orchestrator), and the
watcher's settings record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prime_async.types import PauseMode


class Admission(Protocol):
    """The part of the orchestrator's admission (`orchestrator/admission.py`) the watcher drives: the
    served version new groups are stamped with, and holds while engines are paused or down."""

    served_version: int

    def set_served_version(self, version: int) -> None: ...

    def hold(self) -> None: ...

    def release(self) -> None: ...


class LoadSchedule(Protocol):
    """Deterministic runs (`orchestrator/schedule.py`): when version `version` may be loaded."""

    async def wait_loadable(self, version: int) -> None: ...


class Drainable(Protocol):
    """The part of the group table (`groups.py`) the watcher uses."""

    @property
    def num_inflight_groups(self) -> int: ...

    def cancel_unshippable(self) -> list[int]: ...

    async def wait_idle(self) -> None: ...


@dataclass(frozen=True)
class WatcherSettings:
    """How updates run: `pause_mode` (the orchestrator forces `drain` in deterministic runs), load a
    version once it is `update_interval` ahead of the served one, poll every `poll_interval_s` (a fallback:
    the trainer's announcement wakes the watcher)."""

    pause_mode: PauseMode
    update_interval: int
    poll_interval_s: float
