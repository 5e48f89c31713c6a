"""Schema of `uv run trainer @ trainer.toml` (`TrainerConfig`). No torch import here.

Sections besides the run-wide keys `rl` shares: `optim`, `loss`, `ckpt` (checkpoints and `resume`),
`health`, `weights`, `runtime` (how the process runs on its device: seed, threads, compile, activation
checkpointing, memory share), `megatron`. At most 20 keys per class; a key that moved into a section is
refused with one line naming its new key (`MOVED_KEYS`).

Invariants: every field is documented and bounded; the loss is a discriminated union on `type`;
cross-field checks name the TOML key and the fix. Every built-in loss config states its trust region as a
log-ratio radius (`trust_region_radius`), which the off-policy warning (`offpolicy_warning`) compares with
the configured off-policy distance.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.health import HealthConfig
from prime_async.config.megatron import MegatronConfig, refuse_vision_language, validate_megatron_setup
from prime_async.config.moved import refuse_moved
from prime_async.config.shared import (
    DEFAULT_OUTPUT_DIR,
    LogConfig,
    LoraConfig,
    ModelConfig,
    TransportConfig,
    WandbConfig,
    WeightsConfig,
)

logger = logging.getLogger(__name__)

# Assumed drift of a token's |log rho| per optimizer step, for the off-policy warning only. A mismatch KL
# (k3) of ~1e-3 per version, typical of async runs at RL learning rates, is an RMS |log rho| of about
# sqrt(2 * 1e-3) ~ 0.045.
DRIFT_PER_STEP = 0.05

MOVED_KEYS = {  # old key -> its key now: each gives a one-line error naming the new key
    **{
        key: f"runtime.{key}"
        for key in ("activation_checkpointing", "compile", "threads", "mem_fraction", "seed")
    },
    "resume": "ckpt.resume",
}


def _band_radius(low_ratio: float, high_ratio: float) -> float:
    """Smallest |log rho| that leaves the ratio band [low_ratio, high_ratio] (inf for a bound of 0)."""
    low = -math.log(low_ratio) if low_ratio > 0 else math.inf
    return min(math.log(high_ratio), low)


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
    num_steps_per_batch: int = Field(
        1,
        ge=1,
        le=256,
        description="Optimizer steps per batch: each rank's micro-batches are split into this many "
        "mini-batches (contiguous, sizes differing by at most one), one optimizer step each, each "
        "normalized by its own loss tokens. A mini-batch without loss tokens on every rank takes no step. "
        "The batch still publishes one version; the LR schedule counts batches.",
    )
    vision_tower: Literal["trained", "frozen"] = Field(
        "trained",
        description="A vision-language model's vision tower (and its projector): trained with the rest, or "
        "frozen (its weights never change; published weights still hold it). Ignored for text models.",
    )


class MaskLossConfig(BaseConfig):
    """Default token-level ratio objective: tokens with rho_t outside [low, high] are masked (IcePop)."""

    type: Literal["mask"] = Field("mask", description="Loss variant.")
    ratio_low: float = Field(0.5, gt=0, le=1, description="Mask tokens with rho_t below this.")
    ratio_high: float = Field(2.0, ge=1, description="Mask tokens with rho_t above this.")

    def trust_region_radius(self, seq_len: int) -> float:
        return _band_radius(self.ratio_low, self.ratio_high)


class PPOClipLossConfig(BaseConfig):
    """Standard clipped surrogate with the sampler logprob as the old logprob."""

    type: Literal["ppo_clip"] = Field("ppo_clip", description="Loss variant.")
    clip_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: rho_t >= 1 - clip_low.")
    clip_high: float = Field(0.28, gt=0, description="Upper clip: rho_t <= 1 + clip_high.")

    def trust_region_radius(self, seq_len: int) -> float:
        return _band_radius(1 - self.clip_low, 1 + self.clip_high)


class M2POLossConfig(BaseConfig):
    """M2PO (Zheng et al. 2025): mask the largest (log rho)^2 tokens until their second moment <= tau."""

    type: Literal["m2po"] = Field("m2po", description="Loss variant.")
    m2_threshold: float = Field(
        0.04, gt=0, description="Bound on the mean of (log rho_t)^2 over kept tokens."
    )

    def trust_region_radius(self, seq_len: int) -> float:
        return math.sqrt(self.m2_threshold)  # RMS |log rho| at which tokens start being dropped


class TISLossConfig(BaseConfig):
    """TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
    policy gradient weighted by the truncated, detached token ratio min(rho_t, cap)."""

    type: Literal["tis"] = Field("tis", description="Loss variant.")
    cap: float = Field(2.0, ge=1, le=1e4, description="Truncation C of the token weight min(rho_t, C).")

    def trust_region_radius(self, seq_len: int) -> float:
        return math.log(self.cap)  # the weight stops following rho there (no token is ever masked)


class CISPOLossConfig(BaseConfig):
    """CISPO (MiniMax-M1, 2025): policy gradient weighted by the detached token ratio clipped to
    [1 - clip_low, 1 + clip_high]; every token keeps its gradient."""

    type: Literal["cispo"] = Field("cispo", description="Loss variant.")
    clip_low: float = Field(
        1.0, gt=0, le=1, description="Weight >= 1 - clip_low (1 = no lower bound, as in MiniMax-M1)."
    )
    clip_high: float = Field(1.0, gt=0, le=1e4, description="Weight <= 1 + clip_high.")

    def trust_region_radius(self, seq_len: int) -> float:
        return _band_radius(1 - self.clip_low, 1 + self.clip_high)


class GSPOLossConfig(BaseConfig):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the PPO clipped objective on the
    sequence ratio s_i = exp(mean of log rho_t over sample i's loss tokens), applied to each loss token."""

    type: Literal["gspo"] = Field("gspo", description="Loss variant.")
    clip_low: float = Field(3e-4, gt=0, lt=1, description="Lower clip: s_i >= 1 - clip_low (paper: 3e-4).")
    clip_high: float = Field(4e-4, gt=0, le=10, description="Upper clip: s_i <= 1 + clip_high (paper: 4e-4).")

    def trust_region_radius(self, seq_len: int) -> float:
        # the band bounds a mean of token log-ratios: a drift shared by all tokens moves it one for one
        return _band_radius(1 - self.clip_low, 1 + self.clip_high)


class MISLossConfig(BaseConfig):
    """Sequence-level masked IS (Seq-MIS; Liu et al. 2025, "When speed kills stability"): samples whose
    ratio prod_t rho_t leaves [ratio_low, ratio_high] get no gradient; the others are weighted by it."""

    type: Literal["mis"] = Field("mis", description="Loss variant.")
    ratio_low: float = Field(0.5, gt=0, le=1, description="Mask samples with prod_t rho_t below this.")
    ratio_high: float = Field(2.0, ge=1, le=1e4, description="Mask samples with prod_t rho_t above this.")

    def trust_region_radius(self, seq_len: int) -> float:
        # the band bounds a sum of token log-ratios: per token, worst case a sample filling the row
        return _band_radius(self.ratio_low, self.ratio_high) / seq_len


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

    def trust_region_radius(self, seq_len: int) -> float | None:
        return None  # unknown: no off-policy warning


LossConfig = Annotated[
    MaskLossConfig
    | PPOClipLossConfig
    | M2POLossConfig
    | TISLossConfig
    | CISPOLossConfig
    | GSPOLossConfig
    | MISLossConfig
    | CustomLossConfig,
    Field(discriminator="type"),
]


def max_effective_steps(max_off_policy_steps: int | None, num_steps_per_batch: int) -> int:
    """Largest `offpolicy/effective_steps` a run can log: a token K versions old (K = 0 when unset) in
    the batch's last mini-batch, i.e. (K + 1) * num_steps_per_batch - 1 optimizer steps."""
    return ((max_off_policy_steps or 0) + 1) * num_steps_per_batch - 1


def offpolicy_warning(cfg: TrainerConfig) -> str | None:
    """The warning text when the configured off-policy distance outruns the loss's trust region.

    Rule: with D = `max_effective_steps` and r the loss's log-ratio radius, warn when D * DRIFT_PER_STEP
    > r, i.e. when tokens at the largest distance are expected to have left the trust region."""
    radius = cfg.loss.trust_region_radius(cfg.seq_len)
    distance = max_effective_steps(cfg.max_off_policy_steps, cfg.optim.num_steps_per_batch)
    if radius is None or distance * DRIFT_PER_STEP <= radius:
        return None
    return (
        f"max_off_policy_steps = {cfg.max_off_policy_steps or 0} with optim.num_steps_per_batch = "
        f"{cfg.optim.num_steps_per_batch} trains tokens up to {distance} optimizer steps off-policy: at an "
        f"assumed {DRIFT_PER_STEP} nats of |log rho| per step that outruns the trust region of loss.type = "
        f"{cfg.loss.type!r} (|log ratio| <= {radius:.3g}), so expect a large masked_fraction or truncated "
        "weights; lower max_off_policy_steps or optim.num_steps_per_batch, or widen the loss's band"
    )


class CkptConfig(BaseConfig):
    """Full training-state checkpoints (model, optimizer, scheduler, step, RNG) for `ckpt.resume`."""

    interval: int | None = Field(
        None,
        ge=1,
        description="Checkpoint every this many steps (None = never; `resume` then has nothing).",
    )
    keep: int | None = Field(2, ge=1, description="Keep this many newest checkpoints (None = all).")
    resume: bool = Field(
        False, description="Continue from the latest complete checkpoint under output_dir (rl: on restart)."
    )

    @model_validator(mode="after")
    def _check(self) -> CkptConfig:
        if self.resume and self.interval is None:
            raise ValueError("ckpt.resume = true needs checkpoints: set ckpt.interval")
        return self


class RuntimeConfig(BaseConfig):
    """`[trainer.runtime]`: how the trainer process runs on its device: the torch RNG seed, intra-op
    threads, torch.compile, activation checkpointing, and its share of the GPU's memory."""

    seed: int = Field(0, description="Seed of torch RNG (dropout-free models are deterministic anyway).")
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None = 1 on CPU, torch default on GPU)."
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (on CPU, SmolLM2: ~30 s of compilation for ~5% faster "
        "steps, so off by default).",
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    mem_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of its GPU each trainer rank may allocate (torch's per-process memory "
        "fraction; CPU: not enforced). Required with weights.transport = 'shared' (one device shared with "
        "the engine): trainer.runtime.mem_fraction + inference.engine.mem_fraction <= 1. None = no cap.",
    )


DEFAULT_KEEP_LAST = 3


class TrainerWeightsConfig(WeightsConfig):
    """Weight transfer (shared with the orchestrator) and the versions kept under
    `output_dir/broadcasts/step_{n}/`."""

    keep_last: int = Field(
        DEFAULT_KEEP_LAST,
        ge=2,
        description="Keep this many newest broadcast dirs (>= 2: the orchestrator may still load the "
        "previous "
        "one while the newest is written), plus those of checkpoint steps. `rl` raises it to K + 1 in a "
        "deterministic run (every version is loaded in turn).",
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
    health: HealthConfig = Field(default_factory=HealthConfig, description="Training-health alarms.")
    weights: TrainerWeightsConfig = Field(
        default_factory=TrainerWeightsConfig,
        description="Weight updates (the [weights] section) and publishing.",
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="Seed, threads, compile, activation checkpointing, GPU memory share.",
    )
    deterministic: bool = Field(
        False,
        description="torch.use_deterministic_algorithms(True), fixed intra-op threads (`runtime.threads`, 1 "
        "on CPU), cuDNN benchmark off and CUBLAS_WORKSPACE_CONFIG set on GPU. Set by `rl` from its "
        "`deterministic`.",
    )
    router_replay: bool = Field(
        False,
        description="MoE routing replay (R3): the MoE layers route each token to the experts the engine "
        "recorded when it was generated (router weights still from the trainer's own probabilities), so "
        "routing noise leaves the importance ratio; `moe/routing_agreement` reports how often the "
        "trainer's own top-k would have agreed. fsdp backend. Set by `rl` from its `router_replay`.",
    )
    backend: Literal["fsdp", "megatron"] = Field(
        "fsdp", description="Training backend: FSDP2 (HF models) or megatron-core (TP/PP, extra `megatron`)."
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="Megatron-core layout (used when backend = 'megatron')."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of full weights (fsdp backend): base weights frozen and out "
        "of the optimizer; broadcasts and checkpoints hold only the adapter (None = full weights).",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, data: Any) -> Any:
        """A key that moved into a section: one line naming its new key (`MOVED_KEYS`)."""
        return refuse_moved(data, MOVED_KEYS, "trainer")

    @model_validator(mode="after")
    def _check_megatron(self) -> TrainerConfig:
        if self.backend == "megatron":
            if self.model.build == "tiny_vlm":
                refuse_vision_language({"vision_config": {}}, "model.build = 'tiny_vlm'")
            validate_megatron_setup(self.megatron, self.model.path)
            if self.router_replay:
                raise ValueError(
                    "router_replay = true with trainer.backend = 'megatron': the megatron backend trains MoE "
                    "models without replay so far; use trainer.backend = 'fsdp', or set router_replay = false"
                )
            if self.lora is not None:
                raise ValueError(
                    "lora with trainer.backend = 'megatron': megatron-core 0.16 has no adapter layers and "
                    "peft wraps torch.nn.Linear, not its tensor-parallel linears; unset lora or use backend "
                    "= 'fsdp'"
                )
        return self

    @model_validator(mode="after")
    def _warn_offpolicy(self) -> TrainerConfig:
        warning = offpolicy_warning(self)
        if warning is not None:
            logger.warning(warning)
        return self
