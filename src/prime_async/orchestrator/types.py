"""Data types of the orchestrator: groups of episodes. Dataclasses only, no logic.

Invariants (enforced by the components that build them, stated here so all agree):
- a group's `dispatch_version` is the weight version inference served when the group was created, and
  the `span.start` of each of its episodes (`rollouts/types.py`);
- a group's episodes all come from one environment (`Group.env`), so group-relative advantages never
  mix environments;
- a finished group holds every trajectory of its `group_size` verifiers episodes, and advantages are
  computed per seat within the group (`Group.seats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prime_async.rollouts.types import Episode

EpisodeOutcome = Literal["trained", "dropped_stale", "filtered", "errored", "cancelled"]


@dataclass
class Group:
    """`group_size` episodes of one prompt, dispatched together at `dispatch_version`."""

    group_id: int
    example_id: int
    dispatch_version: int
    episodes: list[Episode] = field(default_factory=list)
    dispatched_at: float = 0.0
    finished_at: float | None = None
    epoch: int = 0
    env: str = "default"
    """Name of the training environment the prompt came from (`orchestrator.envs[].name`)."""

    @property
    def rewards(self) -> list[float]:
        return [e.reward if e.reward is not None else 0.0 for e in self.episodes]

    def seats(self) -> dict[str, list[int]]:
        """Indices into `episodes` per seat, in first-seen order: the sub-groups advantages use."""
        out: dict[str, list[int]] = {}
        for i, ep in enumerate(self.episodes):
            out.setdefault(ep.seat, []).append(i)
        return out
