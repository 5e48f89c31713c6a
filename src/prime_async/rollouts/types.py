"""Data types of running episodes: `Episode`, its `PolicySpan`, the `RolloutSource` protocol and
`NoGateway` (its no-op capabilities, for sources without a gateway). Dataclasses and protocols only.

Invariants (enforced by the code that builds them, stated here so all agree):
- an episode's `span.start` is the weight version served when its group was dispatched and `span.end`
  the version live when it finished, so `span.end >= span.start`;
- `token_ids`, `loss_mask`, `sampler_logprobs`, `token_versions` of an episode have equal length, and so
  has `routed_experts` (rows) when the run replays MoE routing;
- an `Episode` is one trained trajectory: a multi-agent verifiers episode gives one per trained seat
  trace, each with its `seat` name;
- an `idle` episode (a seat that never acted) has no token and `error` None;
- each of an episode's `images` lies inside `token_ids` (`offset + length <= len(token_ids)`), its tokens
  are prompt tokens (`loss_mask` False, version -1), and the images are in token order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from prime_async.engine_api import SamplingParams

if TYPE_CHECKING:  # the gateway module is heavy; this one stays cheap to import
    from prime_async.rollouts.gateway import GatewayCall

EpisodeStatus = Literal["ok", "idle", "error", "aborted", "cancelled"]
"""`idle`: a seat of a multi-agent episode that never acted (no model call, no token): not an error,
never trained (`rollouts/episode.py`)."""


@dataclass(frozen=True)
class PolicySpan:
    """Versions a rollout was generated under: first (`start`) to last (`end`)."""

    start: int
    end: int


@dataclass(frozen=True)
class EpisodeImage:
    """One image of an episode: its source (a data URL or a local path, as the env gave it), where its
    placeholder tokens sit in `Episode.token_ids` (`offset`, `length`), the processor's `(t, h, w)`
    patch grid, and the model turn (0-based) whose prompt first showed it."""

    url: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    turn: int


@dataclass
class Episode:
    """One rollout: the full token sequence (prompt + completion turns) with per-token RL data."""

    example_id: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    routed_experts: Any = None
    """MoE routing replay: (len(token_ids), layers * k) int16 numpy, the engine's experts per token, -1
    where the engine reported none (e.g. the last token); None without replay."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each token given the ones before it, on loss
    tokens (0.0 elsewhere); None without a teacher."""
    reward: float | None = None
    span: PolicySpan | None = None
    status: EpisodeStatus = "ok"
    error: str | None = None
    truncated: bool = False
    overlong: bool = False  # reached seq_len (the gateway clamped a turn, or the episode was cut to it)
    metrics: dict[str, Any] = field(default_factory=dict)
    seat: str = "agent"
    """The verifiers agent seat (config field name) whose trace this is; "agent" for single-agent envs."""
    images: list[EpisodeImage] = field(default_factory=list)
    """The images in `token_ids` (a vision-language model's prompts), in token order; empty for text."""

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class EngineTraffic:
    """A rollout source's model calls per engine URL: requests in flight (`pending`) and the monotonic
    time of each engine's last answer (`last_answer`); what a stall report shows."""

    pending: dict[str, int] = field(default_factory=dict)
    last_answer: dict[str, float] = field(default_factory=dict)


class RolloutSource(Protocol):
    """Runs single episodes of an environment against inference. Implemented with verifiers
    (`rollouts/verifiers_source.py`) in production, by `simulation.SimulatedRolloutSource` and by
    in-process fakes in tests (`NoGateway` gives the capabilities a source without a gateway lacks).

    `run_episode` returns one `Episode`, or a list of them when the environment's episode trains
    several trajectories (one per seat of a multi-agent env); `num_examples` is None for an infinite
    (streamed) taskset, whose example ids are then 0, 1, 2, ... in draw order.

    `run_episode` never raises for environment faults: it returns an Episode with status "error"
    and `error` set. It raises `asyncio.CancelledError` when cancelled (the dispatcher's cancel path).
    `engine_key` lets the gateway keep every turn of one episode on one engine (sticky routing);
    `replay` (None: none) is the model calls an earlier lifetime recorded for that episode, answered
    from the record before any new call reaches an engine (`rollouts/replay.py`).

    Every implementation declares the rest, a no-op where it has nothing to say:
    - `recorded_calls(key)`: the model calls the running episode `key` made so far (checkpoint carry);
    - `take_cancelled_lengths(key)`: what the cancelled episode `key` had sampled, one length per
      trajectory, forgotten once taken (the length bias);
    - `freeze(timeout_s)` / `release()`: a planned stop holds every model call, then refuses them;
    - `engine_traffic()`: requests in flight and last answers per engine (stall reports);
    - `metrics()`: cumulative counters since start (`env/...`).
    """

    @property
    def num_examples(self) -> int | None: ...

    async def run_episode(
        self, *, example_id: int, engine_key: str, sampling: SamplingParams,
        replay: list[GatewayCall] | None = None,
    ) -> Episode | list[Episode]: ...  # fmt: skip

    def recorded_calls(self, engine_key: str) -> list[GatewayCall]: ...

    def take_cancelled_lengths(self, engine_key: str) -> list[int]: ...

    async def freeze(self, timeout_s: float) -> None: ...

    def release(self) -> None: ...

    def engine_traffic(self) -> EngineTraffic: ...

    def metrics(self) -> dict[str, float]: ...


class NoGateway:
    """The `RolloutSource` capabilities of a source whose episodes make no recorded model calls: none
    recorded, nothing cancelled kept, nothing to freeze, no traffic, no metrics. Subclass and override."""

    def recorded_calls(self, engine_key: str) -> list[GatewayCall]:
        return []

    def take_cancelled_lengths(self, engine_key: str) -> list[int]:
        return []

    async def freeze(self, timeout_s: float) -> None:
        return None

    def release(self) -> None:
        return None

    def engine_traffic(self) -> EngineTraffic:
        return EngineTraffic()

    def metrics(self) -> dict[str, float]:
        return {}
