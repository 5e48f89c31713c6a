"""Data types of the orchestrator: episodes, groups, policy spans. Dataclasses only, no logic.

Invariants (enforced by the components that build them, stated here so all agree):
- a group's `dispatch_version` is the weight version inference served when the group was created;
- an episode's `span.start == dispatch_version` of its group and `span.end` is the version live when it
  finished, so `span.end >= span.start`;
- `token_ids`, `loss_mask`, `sampler_logprobs`, `token_versions` of an episode have equal length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

EpisodeStatus = Literal["ok", "error", "aborted", "cancelled"]
EpisodeOutcome = Literal["trained", "dropped_stale", "filtered", "errored", "cancelled"]


@dataclass(frozen=True)
class PolicySpan:
    """Versions a rollout was generated under: first (`start`) to last (`end`)."""

    start: int
    end: int


@dataclass
class Episode:
    """One rollout: the full token sequence (prompt + completion turns) with per-token RL data."""

    example_id: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    span: PolicySpan | None = None
    status: EpisodeStatus = "ok"
    error: str | None = None
    truncated: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.loss_mask)


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

    @property
    def rewards(self) -> list[float]:
        return [e.reward if e.reward is not None else 0.0 for e in self.episodes]


class RolloutSource(Protocol):
    """Runs single episodes of an environment against inference. Implemented with verifiers
    (`orchestrator/envs.py`) in production and by in-process fakes in tests.

    `run_episode` never raises for environment faults: it returns an Episode with status "error"
    and `error` set. It raises `asyncio.CancelledError` when cancelled (the dispatcher's cancel path).
    `engine_key` lets the gateway keep every turn of one episode on one engine (sticky routing).
    """

    @property
    def num_examples(self) -> int: ...

    async def run_episode(self, *, example_id: int, engine_key: str, sampling: dict[str, Any]) -> Episode: ...
