"""What an embedded `Engine` is built with: one record instead of 17 keyword arguments.

`EngineSettings.from_config` reads an `inference` command's config (`config/inference.py`); tests and
benchmarks build the record directly, every field but `model_path` has the engine's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prime_async.inference.linear import Kernels
from prime_async.inference.static_decode import DecodeStep

if TYPE_CHECKING:
    from prime_async.config.inference import InferenceConfig


@dataclass(frozen=True)
class EngineSettings:
    """`device` `auto`: CUDA when available; `num_threads` applies on CPU only; `max_running_requests`
    decode slots (1 runs at a time when `deterministic`); `max_len` the context length; `seed` the
    engine's own sampling stream (a request's `sampling_seed` overrides it); LoRA: adapters of rank at
    most `max_lora_rank` on `lora_target_modules` (None: any), at most `max_loaded_loras` at once."""

    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    max_len: int = 2048
    kv_cache_chunk: int = 256
    num_threads: int = 1
    seed: int = 0
    weight_version: str = "0"
    kernels: Kernels = "packed"
    deterministic: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loaded_loras: int = 4
    decode_step: DecodeStep = "auto"
    decode_buckets: list[int] | None = None

    @classmethod
    def from_config(cls, cfg: InferenceConfig) -> EngineSettings:
        """The settings of an `inference` command's embedded engine."""
        e = cfg.engine
        return cls(
            model_path=cfg.model.path, dtype=cfg.model.dtype, device=e.device,
            max_running_requests=e.max_running_requests, max_prefill_tokens=e.max_prefill_tokens,
            max_len=cfg.seq_len, kv_cache_chunk=e.kv_cache_chunk, num_threads=e.num_threads, seed=e.seed,
            weight_version=str(cfg.weight_version), kernels=e.kernels, deterministic=cfg.deterministic,
            max_lora_rank=cfg.lora.rank if cfg.lora else None,
            lora_target_modules=cfg.lora.target_modules if cfg.lora else None,
            max_loaded_loras=cfg.max_loaded_loras, decode_step=e.decode_step, decode_buckets=e.decode_buckets,
        )  # fmt: skip
