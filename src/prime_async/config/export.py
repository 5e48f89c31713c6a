"""Config schemas of the export commands, which write a plain HF model directory. No torch import here.

- `uv run export-lora`: merge a LoRA adapter (a broadcast `step_N/` or any PEFT adapter directory) into
  its base model;
- `uv run export-megatron`: convert a megatron-backend checkpoint (`checkpoints/trainer/step_N/`, any
  TP/PP layout) to HF weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_async.config.base import BaseConfig
from prime_async.config.shared import LogConfig


class ExportLoraConfig(BaseConfig):
    """`uv run export-lora --adapter outputs/run/broadcasts/step_20 --output models/merged`."""

    adapter: Path = Field(..., description="PEFT adapter directory (adapter_config.json + safetensors).")
    output: Path = Field(..., description="Directory of the merged HF model (must not exist or be empty).")
    base: str | None = Field(
        None,
        description="Base model directory (None = `base_model_name_or_path` of adapter_config.json).",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the merged weights.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")


class ExportMegatronConfig(BaseConfig):
    """`uv run export-megatron --checkpoint outputs/run/checkpoints/trainer/step_10 --output models/s10`."""

    checkpoint: Path = Field(..., description="A megatron-backend checkpoint directory (`step_N/`).")
    output: Path = Field(..., description="Directory of the HF model (must not exist or be empty).")
    base: str | None = Field(
        None,
        description="HF directory of the model that was trained, for its config and tokenizer (None = the "
        "`model.path` recorded in the checkpoint).",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the written weights.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
