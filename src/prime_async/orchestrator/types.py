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
from typing import Any

from prime_async.rollouts.types import Episode


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
    finished_by_index: dict[int, list[Episode]] = field(default_factory=dict)
    """The trajectories of each finished episode (index in the group), also while the group runs."""
    carried: CarriedGroup | None = None
    """Work an earlier lifetime of the orchestrator did on this group (`carry.py`), when resumed."""

    @property
    def rewards(self) -> list[float]:
        return [e.reward if e.reward is not None else 0.0 for e in self.episodes]

    def seats(self) -> dict[str, list[int]]:
        """Indices into `episodes` per seat, in first-seen order: the sub-groups advantages use."""
        out: dict[str, list[int]] = {}
        for i, ep in enumerate(self.episodes):
            out.setdefault(ep.seat, []).append(i)
        return out


@dataclass
class CarriedGroup:
    """A group issued but not trained when the orchestrator stopped (or checkpointed), with the work it
    had: every finished episode's trajectories and every unfinished episode's recorded engine calls
    (`rollouts/gateway.GatewayCall`, the last one possibly partial). `dispatch_version` is the group's
    original stamp: a resumed group keeps it, so the staleness rule sees its true age."""

    env: str
    example_id: int
    epoch: int
    dispatch_version: int
    done: dict[int, list[Episode]] = field(default_factory=dict)
    calls: dict[int, list[Any]] = field(default_factory=dict)

    def sampled_tokens(self) -> int:
        """Sampled (trainable) tokens this work holds."""
        done = sum(ep.num_completion_tokens for eps in self.done.values() for ep in eps)
        return done + sum(len(c.output_ids) for calls in self.calls.values() for c in calls)
