"""Request schemas and response shapes of the SGLang 0.5.x native API subset the engine serves.

Used by `inference/server.py`. Shapes follow SGLang with `--skip-tokenizer-init` (token ids only, no
`text`): `/generate` answers `{"output_ids", "meta_info"}` (a list of those for a batch) with
`meta_info.output_token_logprobs` items `[logprob, token_id, null]` and `meta_info.weight_versions`
spans `{"version", "start", "end"}` (end exclusive) over output positions; versions are strings as in
SGLang. Unlike SGLang (which ignores them) unknown fields are rejected: a typo must not silently change
sampling.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from prime_async.inference.engine import RequestOutput
from prime_async.inference.sampler import SamplingParams
from prime_async.types import EnginePauseMode


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(_Strict):
    max_new_tokens: int = Field(128, ge=0, description="0 = score the prompt only (no output token).")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    n: Literal[1] = 1
    stop: list[str] | None = Field(None, max_length=0, description="Strings need a tokenizer: unsupported.")
    skip_special_tokens: bool = True  # accepted for compatibility: no detokenization happens here
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    def to_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, stop_token_ids=frozenset(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, sampling_seed=self.sampling_seed,
        )  # fmt: skip


class GenerateReqInput(_Strict):
    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int = Field(
        0,
        ge=0,
        description="Scoring requests (max_new_tokens = 0): `meta_info.input_top_logprobs`, the top-n "
        "[logprob, token_id, null] of each position from logprob_start_len (SGLang's field; n >= the "
        "vocabulary: all of it). Generation requests: 0 only.",
    )
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: Literal[False] = False
    lora_path: str | list[str | None] | None = Field(
        None, description="Name of a loaded LoRA adapter per prompt (SGLang's field; None = base model)."
    )
    return_routed_experts: bool = Field(
        False, description="MoE: `meta_info.routed_experts`, the experts of every position (SGLang's field)."
    )
    image_data: str | list[str | list[str] | None] | None = Field(
        None,
        description="SGLang's field: the images of each prompt (a batch: one entry per prompt, a string or "
        "a list; one prompt: a string or its list), each a data URL, base64 or a local path; image k "
        "fills the k-th run of image placeholder tokens (`inference/images.py`).",
    )

    def images(self, n: int) -> list[list[str]]:
        """The image items of each of the `n` prompts (empty: none)."""
        data = self.image_data
        if data is None:
            return [[] for _ in range(n)]
        batched = bool(self.input_ids) and isinstance(self.input_ids[0], list)
        if not batched:
            if isinstance(data, str):
                return [[data]]
            if len(data) == 1 and isinstance(data[0], list):
                return [data[0]]
            if any(not isinstance(x, str) for x in data):
                raise ValueError("image_data for one prompt is a string or a list of strings")
            return [list(data)]  # type: ignore[arg-type]
        if not isinstance(data, list) or len(data) != n:
            raise ValueError(f"image_data must be a list with one entry per prompt ({n}) for a batch")
        return [[] if x is None else [x] if isinstance(x, str) else list(x) for x in data]

    def loras(self, n: int) -> list[str | None]:
        """The adapter name of each of the `n` prompts (a single string applies to all)."""
        return _per_item(self.lora_path, n, "lora_path")

    def logprob_starts(self, n: int) -> list[int]:
        """`logprob_start_len` of each of the `n` prompts (-1 = no prompt logprobs)."""
        return _per_item(self.logprob_start_len, n, "logprob_start_len")

    def items(self) -> list[tuple[list[int], SamplingParamsIn, bool, str | None]]:
        """Split into single requests; raise ValueError on inconsistent batch fields."""
        batched = bool(self.input_ids) and isinstance(self.input_ids[0], list)
        prompts: list[list[int]] = self.input_ids if batched else [self.input_ids]  # type: ignore[list-item]
        n = len(prompts)
        if n == 0:
            raise ValueError("input_ids is empty")
        params = _per_item(self.sampling_params or SamplingParamsIn(), n, "sampling_params")
        logprob = _per_item(self.return_logprob, n, "return_logprob")
        rids = _per_item(self.rid, n, "rid")
        if batched and self.rid is not None and not isinstance(self.rid, list):
            raise ValueError("rid must be a list with one id per prompt for a batch")
        return list(zip(prompts, params, logprob, rids, strict=True))


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} items for {n} prompts")
        return value
    return [value] * n


class PauseReqInput(_Strict):
    mode: EnginePauseMode = "abort"


class UpdateWeightsFromDiskReqInput(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    token_step: int = 0

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class InitWeightsUpdateGroupReqInput(_Strict):
    """SGLang's `/init_weights_update_group` payload (`io_struct.InitWeightsUpdateGroupReqInput`)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Strict):
    """SGLang's `/update_weights_from_distributed` payload: one bucket of tensors, broadcast by rank 0."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal[None] = None  # SGLang's per-tensor broadcasts (no "flattened_bucket")
    selector: Literal["target", "all"] = "all"
    torch_empty_cache: bool = False

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class UpdateWeightsFromTensorReqInput(_Strict):
    """SGLang's `/update_weights_from_tensor` payload shape. SGLang's entries are pickled tensors; the
    embedded engine never unpickles: it takes exactly one entry, the JSON text of a shared-memory version
    (`weights/shared_wire.py`), with `load_format = SHARED_LOAD_FORMAT`, and refuses anything else."""

    serialized_named_tensors: list[str] = Field(min_length=1, max_length=1)
    load_format: str | None = Field(None, validate_default=True)  # SGLang's default: pickled tensors
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False

    @field_validator("load_format")
    @classmethod
    def _ours(cls, v: str | None) -> str | None:
        from prime_async.weights.shared_wire import SHARED_LOAD_FORMAT

        if v != SHARED_LOAD_FORMAT:
            raise ValueError(
                f"load_format {v!r}: the embedded engine takes only {SHARED_LOAD_FORMAT!r} (a JSON "
                "shared-memory description); it never unpickles tensors"
            )
        return v

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class LoadLoRAAdapterReqInput(_Strict):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # accepted for compatibility: the embedded engine never evicts adapters
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(_Strict):
    lora_name: str = Field(min_length=1)
    lora_id: str | None = None


class UpdateWeightVersionReqInput(_Strict):
    new_version: str
    abort_all_requests: bool = True

    @field_validator("new_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class DestroyWeightsUpdateGroupReqInput(_Strict):
    group_name: str = "weight_update_group"


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token versions -> runs `{"version", "start", "end"}` (end exclusive)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def generate_response(out: RequestOutput, return_logprob: bool) -> dict[str, Any]:
    """SGLang's answer layout; `routed_experts` as SGLang sends it: base64 of the int32 expert ids of
    positions [0, prompt + completion - 1), layer by layer, k per layer."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": out.weight_version,
        "weight_versions": version_spans(out.versions),
        "e2e_latency": out.latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(out.logprobs, out.output_ids, strict=True)
        ]
    if out.routed_experts is not None:
        raw = out.routed_experts.to(torch.int32).numpy().tobytes()
        meta["routed_experts"] = base64.b64encode(raw).decode("ascii")
    return {"output_ids": out.output_ids, "meta_info": meta}


def score_response(
    prompt: list[int],
    logprobs: list[float | None],
    start: int,
    *,
    rid: str | None,
    weight_version: str,
    latency_s: float,
    tops: list[list[tuple[float, int]] | None] | None = None,
) -> dict[str, Any]:
    """SGLang's answer to a scoring request (`max_new_tokens = 0`): no output, and with `return_logprob`
    `meta_info.input_token_logprobs` items `[logprob, token_id, null]` for positions `start`.. of the
    prompt (the first position's logprob is null); `start` = -1: none. `tops` (per position, or None):
    `meta_info.input_top_logprobs` for the same positions, each a list of `[logprob, token_id, null]`."""
    meta: dict[str, Any] = {
        "id": rid or "",
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(prompt),
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_version": weight_version,
        "weight_versions": [],
        "e2e_latency": latency_s,
        "output_token_logprobs": [],
    }
    if start >= 0:
        meta["input_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(logprobs[start:], prompt[start:], strict=True)
        ]
        if tops is not None:
            meta["input_top_logprobs"] = [
                None if top is None else [[lp, t, None] for lp, t in top] for top in tops[start:]
            ]
    return {"output_ids": [], "meta_info": meta}
