"""Data types of the orchestrator: episodes, groups, policy spans. Dataclasses only, no logic.

Invariants (enforced by the components that build them, stated here so all agree):
- a group's `dispatch_version` is the weight version inference served when the group was created;
- an episode's `span.start == dispatch_version` of its group and `span.end` is the version live when it
  finished, so `span.end >= span.start`;
- `token_ids`, `loss_mask`, `sampler_logprobs`, `token_versions` of an episode have equal length;
- a group's episodes all come from one environment (`Group.env`), so group-relative advantages never
  mix environments;
- an `Episode` is one trained trajectory: a multi-agent verifiers episode gives one per trained seat
  trace, each with its `seat` name; a finished group holds every trajectory of its `group_size`
  verifiers episodes, and advantages are computed per seat within the group (`Group.seats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prime_async.inference.types import SamplingParams

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
    overlong: bool = False  # reached seq_len (the gateway clamped a turn, or the episode was cut to it)
    metrics: dict[str, Any] = field(default_factory=dict)
    seat: str = "agent"
    """The verifiers agent seat (config field name) whose trace this is; "agent" for single-agent envs."""

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


class RolloutSource(Protocol):
    """Runs single episodes of an environment against inference. Implemented with verifiers
    (`orchestrator/envs/source.py`) in production and by in-process fakes in tests.

    `run_episode` returns one `Episode`, or a list of them when the environment's episode trains
    several trajectories (one per seat of a multi-agent env); `num_examples` is None for an infinite
    (streamed) taskset, whose example ids are then 0, 1, 2, ... in draw order.

    `run_episode` never raises for environment faults: it returns an Episode with status "error"
    and `error` set. It raises `asyncio.CancelledError` when cancelled (the dispatcher's cancel path).
    `engine_key` lets the gateway keep every turn of one episode on one engine (sticky routing).
    """

    @property
    def num_examples(self) -> int | None: ...

    async def run_episode(
        self, *, example_id: int, engine_key: str, sampling: SamplingParams
    ) -> Episode | list[Episode]: ...
