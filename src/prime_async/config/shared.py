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
