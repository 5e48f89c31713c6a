"""Small config schemas for the loader tests (independent of the component schemas)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.shared import WandbConfig


class OptimConfig(BaseConfig):
    """Optimizer."""

    lr: float = Field(1e-6, gt=0, description="Learning rate.")
    max_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.99], description="Adam betas.")


class ConstantSchedule(BaseConfig):
    """Constant learning rate."""

    type: Literal["constant"] = Field("constant", description="Variant tag.")


class CosineSchedule(BaseConfig):
    """Cosine decay."""

    type: Literal["cosine"] = Field("cosine", description="Variant tag.")
    min_ratio: float = Field(0.1, ge=0, le=1, description="Final lr / lr.")


class DemoConfig(BaseConfig):
    """A demo command: shaped like the component configs (sections, lists, dicts, unions, checks)."""

    name: str = Field("demo", description="Run name.")
    seq_len: int = Field(128, ge=8, description="Max tokens per sample.")
    max_off_policy_steps: int = Field(1, ge=0, description="K.")
    batch_groups: int = Field(4, ge=1, description="Groups per batch.")
    max_buffered_groups: int | None = Field(None, ge=1, description="None = (K + 1) * batch_groups.")
    mode: Literal["sync", "async"] = Field("async", description="Run mode.")
    tags: list[str] = Field(default_factory=list, description="Free tags.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Environment keyword arguments.")
    output_dir: Path = Field(Path("outputs/demo"), description="Run directory.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    schedule: ConstantSchedule | CosineSchedule = Field(
        default_factory=ConstantSchedule, discriminator="type", description="LR schedule."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb.")

    @model_validator(mode="after")
    def _check_buffer(self) -> DemoConfig:
        if self.max_buffered_groups is not None and self.max_buffered_groups < self.batch_groups:
            raise ValueError(
                f"max_buffered_groups ({self.max_buffered_groups}) < batch_groups ({self.batch_groups}): "
                "set max_buffered_groups >= batch_groups"
            )
        return self


class ShorthandDemo(BaseConfig):
    """A list of sections with a one-item shorthand (as `orchestrator.env` for `envs`)."""

    shorthands: ClassVar[dict[str, str]] = {"item": "items"}
    items: list[OptimConfig] = Field(default_factory=list, description="Optimizers.")
