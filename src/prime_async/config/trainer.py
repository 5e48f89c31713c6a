"""Schema of `uv run trainer @ trainer.toml` (`TrainerConfig`). No torch import here.

Invariants: every field is documented and bounded; the loss is a discriminated union on `type`;
cross-field checks name the TOML key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.megatron import MegatronConfig, validate_megatron_setup
from prime_async.config.shared import (
    DEFAULT_OUTPUT_DIR,
    LogConfig,
    ModelConfig,
    TransportConfig,
    WandbConfig,
)


class OptimConfig(BaseConfig):
    """AdamW with linear warmup then a constant / linear / cosine schedule."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0 to `lr`.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="LR schedule after warmup (linear/cosine decay to `min_lr_ratio * lr` at max_steps).",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of `lr` for decays.")


class MaskLossConfig(BaseConfig):
    """Default token-level ratio objective: tokens with rho_t outside [low, high] are masked (IcePop)."""

    type: Literal["mask"] = Field("mask", description="Loss variant.")
    ratio_low: float = Field(0.5, gt=0, le=1, description="Mask tokens with rho_t below this.")
    ratio_high: float = Field(2.0, ge=1, description="Mask tokens with rho_t above this.")


class PPOClipLossConfig(BaseConfig):
    """Standard clipped surrogate with the sampler logprob as the old logprob."""

    type: Literal["ppo_clip"] = Field("ppo_clip", description="Loss variant.")
    clip_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: rho_t >= 1 - clip_low.")
    clip_high: float = Field(0.28, gt=0, description="Upper clip: rho_t <= 1 + clip_high.")


class M2POLossConfig(BaseConfig):
    """M2PO (Zheng et al. 2025): mask the largest (log rho)^2 tokens until their second moment <= tau."""

    type: Literal["m2po"] = Field("m2po", description="Loss variant.")
    m2_threshold: float = Field(
        0.04, gt=0, description="Bound on the mean of (log rho_t)^2 over kept tokens."
    )


class CustomLossConfig(BaseConfig):
    """A user loss loaded by import path; see `prime_async.trainer.loss.LossFn` for the signature."""

    type: Literal["custom"] = Field("custom", description="Loss variant.")
    import_path: str = Field(..., description="`package.module:function` implementing `LossFn`.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the function."
    )

    @model_validator(mode="after")
    def _check_path(self) -> CustomLossConfig:
        if ":" not in self.import_path:
            raise ValueError("loss.import_path must look like `package.module:function`")
        return self


LossConfig = Annotated[
    MaskLossConfig | PPOClipLossConfig | M2POLossConfig | CustomLossConfig, Field(discriminator="type")
]


class CkptConfig(BaseConfig):
    """Full training-state checkpoints (model, optimizer, scheduler, step, RNG) for `--resume`."""

    interval: int | None = Field(
        None,
        ge=1,
        description="Checkpoint every this many steps (None = never; `--resume` then has nothing).",
    )
    keep: int | None = Field(2, ge=1, description="Keep this many newest checkpoints (None = all).")


class WeightsConfig(BaseConfig):
    """Published weight versions under `output_dir/broadcasts/step_{n}/`."""

    keep_last: int = Field(
        3,
        ge=2,
        description="Keep this many newest broadcast dirs (>= 2: the orchestrator may still load the "
        "previous "
        "one while the newest is written), plus those of checkpoint steps.",
    )


class TrainerConfig(BaseConfig):
    """Trainer: receives batches over ZeroMQ, applies the token-level ratio loss, publishes weights."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model to train.")
    output_dir: Path = Field(
        DEFAULT_OUTPUT_DIR, description="Run directory (broadcasts/, checkpoints/, metrics/)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb logging.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
    seq_len: int = Field(2048, ge=1, description="Maximum tokens of one packed micro-batch row.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many trainer steps (None = forever)."
    )
    max_off_policy_steps: int | None = Field(
        None,
        ge=0,
        description="Defence in depth: fail if `step - batch.min_dispatch_version` exceeds this "
        "(None = no check).",
    )
    transport: TransportConfig = Field(default_factory=TransportConfig, description="Batch stream.")
    num_processes: int = Field(
        1, ge=1, description="Data-parallel world size (torchrun nproc) `rl` launches."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    loss: LossConfig = Field(
        default_factory=MaskLossConfig, description="Loss variant (discriminated on type)."
    )
    ckpt: CkptConfig = Field(default_factory=CkptConfig, description="Checkpointing.")
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="Weight publishing.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    compile: bool = Field(False, description="torch.compile each decoder layer (GPU only in practice).")
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None = 1 on CPU, torch default on GPU)."
    )
    seed: int = Field(0, description="Seed of torch RNG (dropout-free models are deterministic anyway).")
    resume: bool = Field(False, description="Continue from the latest complete checkpoint under output_dir.")
    backend: Literal["fsdp", "megatron"] = Field(
        "fsdp", description="Training backend: FSDP2 (HF models) or megatron-core (TP/PP, extra `megatron`)."
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="Megatron-core layout (used when backend = 'megatron')."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.resume and self.ckpt.interval is None:
            raise ValueError("resume=true needs checkpoints: set ckpt.interval")
        return self

    @model_validator(mode="after")
    def _check_megatron(self) -> TrainerConfig:
        if self.backend == "megatron":
            validate_megatron_setup(self.megatron, self.model.path)
            if self.ckpt.interval is not None or self.resume:
                raise ValueError("backend = 'megatron' has no checkpoints yet: unset ckpt.interval, resume")
        return self
