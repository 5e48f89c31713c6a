"""Types of the SGLang native API as the orchestrator sees it, and the engine-client Protocol.

`inference/client.py` implements `EngineClient` over HTTP against SGLang or the embedded engine;
the orchestrator tests implement it in-process (simulated engine). Nothing else talks to engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prime_async.types import EnginePauseMode

FinishType = Literal["stop", "length", "abort"]


class EngineUnavailable(RuntimeError):
    """The engine could not be reached (refused, reset, timed out): an outage, not a bad request.

    Raised by every `EngineClient`, so callers recognise outages without knowing the HTTP library.
    """


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of an episode's model calls (the orchestrator's `[sampling]` section).

    `max_tokens` None leaves the per-turn limit to the caller (the gateway clamps to `seq_len` anyway).
    `seed` (deterministic runs) seeds the episode: the gateway sends each of its model calls with its
    own `sampling_seed` derived from it (`orchestrator/schedule.py`); it never reaches verifiers.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        """SGLang `/generate` `sampling_params` (its name for the token limit is `max_new_tokens`)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_tokens is not None:
            out["max_new_tokens"] = self.max_tokens
        return out

    def to_vllm(self) -> dict[str, Any]:
        """vLLM/OpenAI key names, as verifiers' `SamplingConfig` takes them."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return out


@dataclass
class GenerateResult:
    """One `/generate` answer reduced to what RL needs.

    `output_logprobs[i]` is the logprob of `output_ids[i]` under the sampling distribution
    (log-softmax of logits / temperature); `token_versions[i]` the weight version it was sampled under.
    `routed_experts` (when asked for) holds the experts of positions [0, prompt + output - 1) of the
    request, flat: position-major, then layer, then the k experts (SGLang's layout).
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    finish_type: FinishType
    prompt_tokens: int
    weight_version: int
    meta_info: dict[str, Any] = field(default_factory=dict)
    routed_experts: Any = None  # MoE + `return_routed_experts`: int32 numpy, flat (positions x layers x k)


class EngineClient(Protocol):
    """What the orchestrator may ask of one inference engine (SGLang or embedded)."""

    base_url: str

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None,
        *, image_data: list[str] | None = None,
    ) -> GenerateResult: ...  # fmt: skip

    async def pause_generation(self, mode: EnginePauseMode) -> None: ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, *, flush_cache: bool, abort_all_requests: bool = False
    ) -> None: ...

    async def flush_cache(self) -> None: ...

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None: ...

    async def weight_version(self) -> int: ...

    async def health(self) -> bool: ...

    async def server_info(self) -> dict[str, Any]:
        """The engine's `/get_server_info`: the embedded engine reports `busy_s` and `uptime_s`
        (`orchestrator/engine_load.py`); an engine without such counters answers without them ({})."""
        ...
