"""Config of the megatron-core trainer backend (`trainer.backend = "megatron"`), and its early validation.

`validate_megatron_setup(megatron, model_path)` runs at config validation time, before any process starts,
and raises a one-line ValueError for each of: the `megatron` extra is not installed, the model's
architecture is not one the HF <-> megatron weight mapping supports, a parallel size that does not divide
the model (heads, kv heads, layers), an unsupported RoPE scaling, or sequence parallelism. The model
checks need the model's config.json offline (a local dir, or a hub id in the HF cache); when it cannot be
found they are deferred, and `MegatronBackend` repeats the whole validation on the real directory before
building anything.

Invariant: this module never imports torch or megatron (it only asks `importlib.util.find_spec`), so
`--help` and `--dry-run` stay fast; the model's `config.json` is read as plain JSON.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any

from pydantic import Field

from prime_async.config.base import BaseConfig

logger = logging.getLogger(__name__)

# HF architecture -> family name used by `trainer/megatron/bridge.py`. Only dense decoder-only models
# whose HF layout the bridge maps name by name (GQA, optional q/k norm, optional qkv bias, tied or untied
# embeddings) are listed; everything else fails at config validation.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# megatron-core 0.16 applies Llama 3.x RoPE scaling with these constants fixed (only `factor` is free).
LLAMA3_ROPE_PARAMS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class MegatronConfig(BaseConfig):
    """Parallel layout and options of the megatron-core backend (used only when `backend = "megatron"`)."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor-parallel size: must divide attention heads and kv heads."
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline-parallel size: must divide the number of layers."
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="Expert-parallel size (MoE models: must divide the number of experts and the number of "
        "trainer processes; experts are not tensor-parallel).",
    )
    sequence_parallel: bool = Field(
        False,
        description="Megatron sequence parallelism. Not supported yet: it needs the TransformerEngine layer "
        "spec, and megatron-core's local (torch) norms, which this backend builds, refuse it.",
    )
    use_distributed_optimizer: bool = Field(
        True,
        description="Shard optimizer state over data-parallel ranks with megatron's distributed optimizer "
        "(GPU path). Without CUDA the backend falls back to torch AdamW on the local shards.",
    )
    overlap_grad_reduce: bool = Field(
        False, description="Overlap the data-parallel gradient reduce with backward (GPU path)."
    )
    make_vocab_size_divisible_by: int = Field(
        128,
        ge=1,
        description="Pad the embedding rows to a multiple of this times tensor_parallel_size; the padding "
        "is sliced off again in logits and in published weights.",
    )
    recompute_activations: bool = Field(
        False, description="Full activation recomputation of every transformer layer (saves memory)."
    )


def megatron_installed() -> bool:
    """True when the optional `megatron` extra (megatron-core) is importable."""
    return importlib.util.find_spec("megatron") is not None and (
        importlib.util.find_spec("megatron.core") is not None
    )


def read_hf_config(model_path: str | Path) -> dict[str, Any]:
    """The model's `config.json` as a dict (ValueError when the directory has none)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model.path: {model_path!s} has no config.json (the megatron backend needs a local HF dir)"
        )
    return json.loads(path.read_text())


def find_hf_config(model_path: str | Path) -> dict[str, Any] | None:
    """`config.json` of a local dir, or of a hub id already in the local HF cache; None when neither."""
    if Path(model_path).is_dir():
        return read_hf_config(model_path)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model_path), "config.json")
    except ValueError:  # tolerated: not a valid repo id either, so nothing to check here
        return None
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None


def rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE theta/type/factor from either the transformers 5 `rope_parameters` or the older keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    llama3 = {key: float(params.get(key, LLAMA3_ROPE_PARAMS[key])) for key in LLAMA3_ROPE_PARAMS}
    return {
        "theta": float(theta),
        "type": rope_type,
        "factor": float(params.get("factor", 1.0)),
        "llama3_params": {k: (int(v) if k.startswith("original") else v) for k, v in llama3.items()},
    }


def refuse_vision_language(hf: dict | None, what: str) -> None:
    """Refuse a vision-language model (`hf`: its config.json, None when unknown; a `vision_config` in it)
    with one line naming `what`: the megatron backend has no vision encoder."""
    if hf is not None and "vision_config" in hf:
        raise ValueError(
            f"trainer.backend = 'megatron' does not train vision-language models ({what} has a vision tower; "
            "the megatron backend builds a text-only GPTModel): use trainer.backend = 'fsdp'"
        )


def validate_megatron_setup(megatron: MegatronConfig, model_path: str | Path) -> None:
    """Fail early, with one clear line, on anything the megatron backend cannot run."""
    refuse_vision_language(find_hf_config(model_path), str(model_path))
    if not megatron_installed():
        raise ValueError(
            "trainer.backend = 'megatron' needs megatron-core: install the extra with "
            "`uv sync --extra megatron --inexact`"
        )
    if megatron.sequence_parallel:
        raise ValueError(
            "trainer.megatron.sequence_parallel = true needs TransformerEngine layer specs, which this "
            "backend does not build yet (megatron-core's local norms refuse it); set it to false"
        )
    hf = find_hf_config(model_path)
    if hf is None:
        # Not resolvable offline here (e.g. a hub id on a machine without that model): the trainer repeats
        # this validation on the real config.json before it builds the model.
        logger.info("megatron: %s is not local; model checks deferred to the trainer start", model_path)
        return
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"trainer.megatron: architecture {arch!r} of {model_path!s} is not supported by the megatron "
            f"backend (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use trainer.backend = 'fsdp'"
        )
    tp, pp = megatron.tensor_parallel_size, megatron.pipeline_parallel_size
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"trainer.megatron.tensor_parallel_size = {tp} must divide num_attention_heads = {heads} and "
            f"num_key_value_heads = {kv_heads}; pick a divisor of {math.gcd(heads, kv_heads)}"
        )
    layers = hf["num_hidden_layers"]
    if layers % pp:
        raise ValueError(
            f"trainer.megatron.pipeline_parallel_size = {pp} must divide num_hidden_layers = {layers}"
        )
    _check_experts(megatron, hf)
    rope = rope_settings(hf)
    if rope["type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"trainer.megatron: rope type {rope['type']!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope["type"] == "llama3" and rope["llama3_params"] != LLAMA3_ROPE_PARAMS:
        raise ValueError(
            f"trainer.megatron: llama3 rope parameters {rope['llama3_params']} differ from the ones "
            f"megatron-core hard-codes {LLAMA3_ROPE_PARAMS}"
        )


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _check_experts(megatron: MegatronConfig, hf: dict[str, Any]) -> None:
    ep, experts = megatron.expert_parallel_size, num_experts(hf)
    if ep > 1 and not experts:
        raise ValueError(f"trainer.megatron.expert_parallel_size = {ep} needs an MoE model (this is dense)")
    if experts and experts % ep:
        raise ValueError(
            f"trainer.megatron.expert_parallel_size = {ep} must divide the model's {experts} experts"
        )
    if experts and megatron.tensor_parallel_size > 1:
        raise ValueError(
            f"trainer.megatron.tensor_parallel_size = {megatron.tensor_parallel_size} with an MoE model: "
            "megatron-core needs sequence parallelism for MoE under TP, which needs TransformerEngine "
            "(not built here); use tensor_parallel_size = 1 and expert_parallel_size"
        )
    if experts and (hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1):
        raise ValueError("trainer.megatron: MoE models with dense layers between sparse ones are not mapped")
