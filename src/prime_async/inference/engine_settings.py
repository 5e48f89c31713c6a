"""What an embedded `Engine` is built with: one record (two small sections) instead of 17 keyword
arguments.

`EngineSettings.from_config` reads an `inference` command's config (`config/inference.py`); tests and
benchmarks build the record directly, every field but `model_path` has the engine's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prime_async.inference.linear import Kernels
from prime_async.inference.static_decode import DecodeStep

if TYPE_CHECKING:
    from prime_async.config.inference import InferenceConfig


@dataclass(frozen=True)
class SlotSettings:
    """The running batch: `max_running_requests` decode slots, prefill at most `max_prefill_tokens` per
    step, `max_len` the context length, KV allocated in chunks of `kv_cache_chunk` positions; the decode
    step (`static_decode.py`: eager, static or CUDA graphs) over batch buckets `decode_buckets`."""

    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    max_len: int = 2048
    kv_cache_chunk: int = 256
    decode_step: DecodeStep = "auto"
    decode_buckets: list[int] | None = None


@dataclass(frozen=True)
class LoraLimits:
    """Adapters of rank at most `max_rank` on `target_modules` (None: any), at most `max_loaded` at once."""

    max_rank: int | None = None
    target_modules: list[str] | None = None
    max_loaded: int = 4


@dataclass(frozen=True)
class EngineSettings:
    """`device` `auto`: CUDA when available; `num_threads` applies on CPU only; `seed` the engine's own
    sampling stream (a request's `sampling_seed` overrides it); `deterministic`: one request at a time."""

    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int = 1
    seed: int = 0
    weight_version: str = "0"
    kernels: Kernels = "packed"
    deterministic: bool = False
    slots: SlotSettings = field(default_factory=SlotSettings)
    lora: LoraLimits = field(default_factory=LoraLimits)

    @classmethod
    def from_config(cls, cfg: InferenceConfig) -> EngineSettings:
        """The settings of an `inference` command's embedded engine."""
        e = cfg.engine
        slots = SlotSettings(
            max_running_requests=e.max_running_requests, max_prefill_tokens=e.max_prefill_tokens,
            max_len=cfg.seq_len, kv_cache_chunk=e.kv_cache_chunk, decode_step=e.decode_step,
            decode_buckets=e.decode_buckets,
        )  # fmt: skip
        lora = LoraLimits(
            max_rank=cfg.lora.rank if cfg.lora else None,
            target_modules=cfg.lora.target_modules if cfg.lora else None,
            max_loaded=cfg.max_loaded_loras,
        )
        return cls(
            model_path=cfg.model.path, dtype=cfg.model.dtype, device=e.device, num_threads=e.num_threads,
            seed=e.seed, weight_version=str(cfg.weight_version), kernels=e.kernels,
            deterministic=cfg.deterministic, slots=slots, lora=lora,
        )  # fmt: skip
