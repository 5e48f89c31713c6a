"""Config schema of `uv run inference`: the embedded torch engine or SGLang server(s).

`prime_async.entrypoints.inference` parses this and calls `prime_async.inference.server.run(cfg)`.
Invariants: no torch import here; a non-loopback host requires an API key (admin routes pause/update
weights must never be open to the network).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.shared import (
    DEFAULT_OUTPUT_DIR,
    RUN_ID_DESCRIPTION,
    LogConfig,
    LoraConfig,
    ModelConfig,
    WandbConfig,
)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ServerConfig(BaseConfig):
    """HTTP server of the engine (SGLang native API)."""

    host: str = Field("127.0.0.1", description="Address to bind. Non-loopback requires `server.api_key`.")
    port: int = Field(
        30000,
        ge=0,
        le=65535,
        description="Port of the first engine; engine i of N serves on port + i (0: `rl` picks free ports).",
    )
    api_key: str | None = Field(
        None, description="When set, every route except /health requires `Authorization: Bearer <key>`."
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> ServerConfig:
        if self.host not in _LOOPBACK and not self.api_key:
            raise ValueError(
                f"server.host = {self.host!r} is not loopback: set server.api_key (or bind 127.0.0.1)"
            )
        return self


class EngineConfig(BaseConfig):
    """Embedded torch engine (backend = "torch"): continuous batching over a preallocated KV cache."""

    max_running_requests: int = Field(
        64, ge=1, le=4096, description="Requests decoded together (KV-cache slots); more wait in the queue."
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="Prompt tokens prefilled between two decode steps (bounds how long new arrivals stall "
        "running requests); a single longer prompt is still admitted alone.",
    )
    kv_cache_chunk: int = Field(
        256, ge=16, description="KV-cache length grows in chunks of this many positions, up to seq_len."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    num_threads: int = Field(
        1, ge=1, description="torch intra-op threads on CPU (1: the trainer shares the cores)."
    )
    mem_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of its GPU the embedded engine may allocate: weights and the KV cache (torch's "
        "per-process memory fraction; CPU: not enforced). Required with weights.transport = 'shared' "
        "(one device shared with the trainer): trainer.runtime.mem_fraction + this <= 1. None = no cap.",
    )
    seed: int = Field(0, description="Seed of the sampler for requests without `sampling_seed`.")
    kernels: Literal["packed", "dense"] = Field(
        "packed",
        description="CPU projections: packed = weights also kept in oneDNN's blocked layout (faster matmuls "
        "at decode batch sizes, one more copy of the weights in memory); dense = plain F.linear.",
    )
    decode_step: Literal["auto", "eager", "static", "graphs"] = Field(
        "auto",
        description="How a decode step runs: static = padded to a batch bucket (decode_buckets) and to a "
        "power-of-two KV span, fixed shapes; graphs = the static step captured once per (bucket, span) as a "
        "CUDA graph and replayed (CUDA only: a step is otherwise bound by kernel launches); eager = shapes "
        "follow the batch. auto = graphs on CUDA, static on CPU. Steps with a LoRA row always run eager.",
    )
    decode_buckets: list[int] | None = Field(
        None,
        description="Batch sizes a static decode step is padded to, strictly increasing, each <= "
        "max_running_requests (which is appended when missing). None = 1, 2, 4, ..., max_running_requests.",
    )

    @model_validator(mode="after")
    def _check_decode(self) -> EngineConfig:
        if self.decode_step == "graphs" and self.device == "cpu":
            raise ValueError("engine.decode_step = 'graphs' needs CUDA, but engine.device = 'cpu'")
        buckets, top = self.decode_buckets, self.max_running_requests
        if buckets is not None and (
            buckets != sorted(set(buckets)) or not all(1 <= b <= top for b in buckets)
        ):
            raise ValueError(
                f"engine.decode_buckets {buckets}: must increase strictly, each in 1..max_running_requests "
                f"({top})"
            )
        return self


class SGLangConfig(BaseConfig):
    """SGLang server(s) (backend = "sglang"), launched with `python -m sglang.launch_server`."""

    num_engines: int = Field(
        1, ge=1, description="Independent SGLang servers on consecutive ports (one per GPU group)."
    )
    dp: int = Field(1, ge=1, description="SGLang data parallelism inside one server (`--dp-size`).")
    tp: int = Field(1, ge=1, description="Tensor parallelism per server (`--tp-size`).")
    mem_fraction: float = Field(
        0.8, gt=0, le=1, description="`--mem-fraction-static`: GPU memory share for weights + KV cache."
    )
    max_running_requests: int | None = Field(
        None, ge=1, description="`--max-running-requests`; None lets SGLang choose."
    )
    gpu_ids: list[int] | None = Field(
        None,
        description="GPUs of the standalone `inference` command, as indices into the devices it sees; engine "
        "i gets gpu_ids[i*tp*dp:(i+1)*tp*dp]. None = 0..N-1. Under `rl` set gpus.inference instead.",
    )
    python: str = Field("python", description="Python executable that has sglang installed.")
    extra_args: list[str] = Field(
        default_factory=list, description="Extra flags appended verbatim to every launch_server command."
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, description="How long to wait for every server's /health before failing."
    )


class InferenceConfig(BaseConfig):
    """`uv run inference @ inference.toml`."""

    backend: Literal["torch", "sglang"] = Field(
        "torch", description="torch = embedded engine (CPU or one GPU); sglang = launch SGLang server(s)."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model to serve.")
    output_dir: Path = Field(DEFAULT_OUTPUT_DIR, description="Run directory (logs under output_dir/logs).")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb logging.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server.")
    seq_len: int = Field(
        2048, ge=2, description="Max context (prompt + generated tokens) of one request; longer is a 400."
    )
    weight_version: int = Field(0, ge=0, description="Version label of the initial weights (v0).")
    run_id: str | None = Field(None, description=RUN_ID_DESCRIPTION)
    deterministic: bool = Field(
        False,
        description="Batch-invariant generation (a request's tokens and logprobs do not depend on what "
        "else runs): the embedded engine runs one request at a time; SGLang gets "
        "`--enable-deterministic-inference`. Set by `rl` from its `deterministic`.",
    )
    router_replay: bool = Field(
        False,
        description="MoE routing replay (R3): SGLang gets `--enable-return-routed-experts`; the embedded "
        "engine returns routed experts whenever a request asks. Set by `rl` from its `router_replay`.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Embedded engine (torch).")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="SGLang launcher (sglang).")
    lora: LoraConfig | None = Field(
        None,
        description="Serve LoRA adapters of this shape (`/load_lora_adapter`, `lora_path` per request): "
        "SGLang gets --enable-lora, --max-lora-rank = rank and --lora-target-modules; the embedded engine "
        "refuses adapters of a larger rank or other modules. None = full-weight updates only.",
    )
    max_loaded_loras: int = Field(
        4, ge=1, description="Adapters loaded at once (SGLang `--max-loaded-loras`, `--max-loras-per-batch`)."
    )
