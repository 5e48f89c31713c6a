"""Config sections shared by several commands (model, wandb, output).

`rl` owns one copy of each and propagates it into the inference, orchestrator and trainer configs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_async.config.base import BaseConfig


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

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Console log level.")


DEFAULT_OUTPUT_DIR = Path("outputs/run")


class TransportConfig(BaseConfig):
    """ZeroMQ batch stream orchestrator -> trainer. The orchestrator binds, trainer ranks connect."""

    host: str = Field("127.0.0.1", description="Address the orchestrator binds and trainer ranks connect to.")
    port: int = Field(5557, ge=1, le=65535, description="TCP port of the batch stream.")
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
        "with --resume can fetch them again; set >= trainer ckpt.interval.",
    )
