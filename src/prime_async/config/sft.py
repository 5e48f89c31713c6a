"""Schema of `uv run sft @ sft.toml` (`SFTConfig`): the trainer's config plus where the data comes from.

`SFTConfig` is a `TrainerConfig`, so backends (fsdp, megatron), LoRA, checkpoints, resume and weight
publishing are the same keys with the same meaning; `[data]` says which chats are trained. No torch import.

Invariants: exactly one data source (`data.files` or `data.env`); keys that mean nothing without a
sampler or an orchestrator (`loss`, `max_off_policy_steps`, `transport`, `router_replay`) are refused
with one line naming them, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.trainer import TrainerConfig


class SFTTasksetConfig(BaseConfig):
    """A verifiers taskset as SFT data: each task's prompt (system prompt + user turn) and its reference
    answer as the assistant turn."""

    id: str = Field(..., description="Environment id (an installed verifiers environment package).")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the taskset config, e.g. {num_examples = 1000, seed = 1}.",
    )
    answer_field: str = Field(
        "answer", description="The task data field that holds the reference answer (str() of its value)."
    )


class SFTDataConfig(BaseConfig):
    """Where the chats come from, and how they are cut into steps."""

    files: list[Path] = Field(
        default_factory=list,
        description="JSONL (`.jsonl`) or Parquet (`.parquet`) files; each row has `messages` (a list of "
        "{role, content}) and optionally `tools` (JSON tool schemas the template renders).",
    )
    env: SFTTasksetConfig | None = Field(
        None, description="A verifiers taskset with reference answers (instead of files)."
    )
    batch_size: int = Field(16, ge=1, description="Chats per optimizer step (whole batch, all ranks).")
    shuffle_seed: int = Field(0, description="Seed of each epoch's order (epoch e uses seed + e).")
    train_on: list[str] = Field(
        default_factory=lambda: ["assistant"],
        description="Roles whose turns are trained (the tokens the model would sample for them).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SFTDataConfig:
        if bool(self.files) == (self.env is not None):
            raise ValueError("data: set exactly one of data.files (JSONL/Parquet) and data.env (a taskset)")
        for path in self.files:
            if path.suffix not in (".jsonl", ".parquet"):
                raise ValueError(f"data.files: {path} is neither .jsonl nor .parquet")
        return self


class SFTConfig(TrainerConfig):
    """`uv run sft @ sft.toml`: supervised fine-tuning on the trainer's backends."""

    data: SFTDataConfig = Field(..., description="The chats to train on.")
    publish_interval: int = Field(
        10, ge=1, description="Publish a version (broadcasts/step_n) every this many steps, and the last one."
    )
    final_dir: Path | None = Field(
        None,
        description="Where the last version is copied as a model directory `rl`/`eval` can load (None = "
        "`output_dir/final`).",
    )

    @model_validator(mode="after")
    def _check_sft(self) -> SFTConfig:
        ignored = sorted({"loss", "max_off_policy_steps", "transport"} & self.model_fields_set)
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: sft has no sampler and no orchestrator (its loss is the "
                             "NLL of the data); remove these keys")  # fmt: skip
        if self.router_replay:
            raise ValueError("router_replay with sft: SFT data has no engine routing to replay; unset it")
        if self.weights.transport != "filesystem":
            raise ValueError(f"weights.transport = '{self.weights.transport}' with sft: there are no "
                             "engines to hand weights to; use 'filesystem' (versions land in "
                             "output_dir/broadcasts)")  # fmt: skip
        if self.max_steps is None:
            raise ValueError("max_steps: sft needs a number of steps (epochs = max_steps * batch / examples)")
        return self

    @property
    def final_model_dir(self) -> Path:
        return self.final_dir or Path(self.output_dir) / "final"
