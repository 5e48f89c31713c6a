"""Optimizer and learning-rate schedule from `OptimConfig`, shared by the FSDP and megatron backends.

Invariants: both backends apply `lr * lr_factor(cfg, n, max_steps)` at optimizer step n (0-based), so a
config trains with the same schedule on either backend. The FSDP backend's AdamW runs torch's fused
kernel where it exists (CPU and CUDA float parameters): one pass over parameters, gradients and moments
instead of a dozen (on CPU the single-tensor loop costs ~5x more); same update up to rounding.
"""

from __future__ import annotations

import math

import torch

from prime_async.config.trainer import OptimConfig


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: base weights stay out
    if not params:
        raise ValueError("the model has no trainable parameter")
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True if _fused_supported(params) else None,
    )


def _fused_supported(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, max_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s, max_steps))


def lr_factor(cfg: OptimConfig, step: int, max_steps: int | None) -> float:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based): warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant" or max_steps is None or max_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps))
    decay = 1 - progress if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay
