"""Types of the SGLang native API as the orchestrator sees it, and the engine-client Protocol.

`inference/client.py` implements `EngineClient` over HTTP against SGLang or the embedded engine;
the orchestrator tests implement it in-process (simulated engine). Nothing else talks to engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

PauseMode = Literal["abort", "retract", "in_place"]
FinishType = Literal["stop", "length", "abort"]


@dataclass
class VersionSpan:
    """Output positions [start, end) were sampled under weights `version` (SGLang `weight_versions`)."""

    version: int
    start: int
    end: int


@dataclass
class GenerateResult:
    """One `/generate` answer reduced to what RL needs.

    `output_logprobs[i]` is the logprob of `output_ids[i]` under the sampling distribution
    (log-softmax of logits / temperature); `token_versions[i]` the weight version it was sampled under.
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    finish_type: FinishType
    prompt_tokens: int
    weight_version: int
    meta_info: dict[str, Any] = field(default_factory=dict)


class EngineClient(Protocol):
    """What the orchestrator may ask of one inference engine (SGLang or embedded)."""

    base_url: str

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult: ...

    async def pause_generation(self, mode: PauseMode) -> None: ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, *, flush_cache: bool, abort_all_requests: bool = False
    ) -> None: ...

    async def flush_cache(self) -> None: ...

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None: ...

    async def weight_version(self) -> int: ...

    async def health(self) -> bool: ...
