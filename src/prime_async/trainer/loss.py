"""Token-level importance-ratio losses, as pure functions of per-token tensors.

Every loss sees one packed micro-batch as flat (T,) tensors:
    logp           log pi_theta(a_t) at the sampling temperature (requires grad)
    sampler_logp   log mu(a_t) recorded by the sampler (the behaviour policy, token by token)
    advantages     A_t (group-relative advantage of the token's sample)
    loss_mask      True exactly on sampled tokens
    num_loss_tokens  loss tokens of the WHOLE batch (all micro-batches, all ranks)
and returns `LossOutput(loss, masked)`: `loss` is this micro-batch's share of the batch loss, i.e. a sum
over its tokens divided by `num_loss_tokens`, so summing over micro-batches (and ranks) gives the batch
loss; `masked` marks loss tokens the trust region removed from the gradient.

With rho_t = exp(logp - sampler_logp), every built-in loss has gradient -A_t * grad(logp) / N on-policy
(rho_t = 1), i.e. the policy gradient. Variants:
- `mask` (default, IcePop / DPPO-mask style): tokens with rho_t outside [ratio_low, ratio_high] get no
  gradient; the rest contribute -rho_t * A_t.
- `ppo_clip`: -min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t); "masked" = clip active.
- `m2po`: drop the tokens with the largest (log rho_t)^2 until the mean of (log rho_t)^2 over the kept
  loss tokens of the micro-batch is <= m2_threshold (Zheng et al. 2025 bound the batch second moment;
  here it is per micro-batch, which is stricter or equal per row); kept tokens contribute -rho_t * A_t.
- `custom`: a function with the `LossFn` signature, loaded from `loss.import_path`.

Invariant: non-finite inputs (logp, sampler logprobs or advantages on loss tokens) raise
`NonFiniteError` before any loss is formed.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prime_async.config.trainer import (
    CustomLossConfig,
    M2POLossConfig,
    MaskLossConfig,
    PPOClipLossConfig,
)

logger = logging.getLogger(__name__)


class NonFiniteError(ValueError):
    """NaN or inf in the inputs of the loss."""


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: this micro-batch's share of the batch loss
    masked: torch.Tensor  # (T,) bool: loss tokens without gradient (trust region)


class LossFn(Protocol):
    """Signature of every loss, built-in or custom (`loss.kwargs` arrive as extra keyword arguments)."""

    def __call__(
        self,
        *,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        num_loss_tokens: int,
        **kwargs: Any,
    ) -> LossOutput: ...


def check_finite(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, loss_mask) -> None:
    """Raise `NonFiniteError` naming the input that holds NaN/inf on a loss token."""
    for name, t in (("logp", logp), ("sampler_logprobs", sampler_logp), ("advantages", advantages)):
        bad = ~torch.isfinite(t.detach()) & loss_mask
        if bool(bad.any()):
            raise NonFiniteError(f"{name} is NaN/inf on {int(bad.sum())} loss token(s)")


def _ratio(logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp(logp - sampler_logp)


def mask_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, ratio_low, ratio_high
) -> LossOutput:
    rho = _ratio(logp, sampler_logp)
    masked = loss_mask & ((rho.detach() < ratio_low) | (rho.detach() > ratio_high))
    keep = loss_mask & ~masked
    loss = -(rho * advantages)[keep].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=masked)


def ppo_clip_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, clip_low, clip_high
) -> LossOutput:
    rho = _ratio(logp, sampler_logp)
    unclipped = rho * advantages
    clipped = torch.clamp(rho, 1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    masked = loss_mask & (clipped.detach() < unclipped.detach())
    loss = per_token[loss_mask].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=masked)


def m2po_keep_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor, m2_threshold: float) -> torch.Tensor:
    """Keep the loss tokens with the smallest (log rho)^2 such that their mean is <= m2_threshold."""
    sq = log_ratio.detach().pow(2)
    idx = torch.nonzero(loss_mask, as_tuple=True)[0]
    keep = torch.zeros_like(loss_mask)
    if idx.numel() == 0:
        return keep
    sorted_sq, order = torch.sort(sq[idx])
    prefix_mean = torch.cumsum(sorted_sq, 0) / torch.arange(1, idx.numel() + 1, dtype=sq.dtype)
    num_keep = int((prefix_mean <= m2_threshold).sum())  # prefix means of sorted values are non-decreasing
    keep[idx[order[:num_keep]]] = True
    return keep


def m2po_loss(*, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, m2_threshold) -> LossOutput:
    log_ratio = logp - sampler_logp
    keep = m2po_keep_mask(log_ratio, loss_mask, m2_threshold)
    loss = -(torch.exp(log_ratio) * advantages)[keep].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=loss_mask & ~keep)


def load_custom_loss(import_path: str) -> LossFn:
    module_name, _, attr = import_path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"loss.import_path {import_path!r} cannot be loaded: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"loss.import_path {import_path!r} is not callable")
    return fn


def build_loss_fn(cfg) -> LossFn:
    """Bind the configured variant's hyper-parameters: returns a `LossFn`."""
    if isinstance(cfg, MaskLossConfig):
        kwargs, fn = {"ratio_low": cfg.ratio_low, "ratio_high": cfg.ratio_high}, mask_loss
    elif isinstance(cfg, PPOClipLossConfig):
        kwargs, fn = {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high}, ppo_clip_loss
    elif isinstance(cfg, M2POLossConfig):
        kwargs, fn = {"m2_threshold": cfg.m2_threshold}, m2po_loss
    elif isinstance(cfg, CustomLossConfig):
        kwargs, fn = dict(cfg.kwargs), load_custom_loss(cfg.import_path)
    else:
        raise AssertionError(f"unhandled loss config {type(cfg).__name__}")

    def loss_fn(*, logp, sampler_logp, advantages, loss_mask, num_loss_tokens) -> LossOutput:
        if num_loss_tokens < 1:
            raise ValueError(
                "num_loss_tokens must be >= 1 (a batch without sampled tokens cannot be trained)"
            )
        check_finite(logp, sampler_logp, advantages, loss_mask)
        # Non-loss positions may hold placeholders; zero them so they cannot leak NaN into gradients.
        sampler_logp = torch.where(loss_mask, sampler_logp, logp.detach())
        advantages = torch.where(loss_mask, advantages, torch.zeros_like(advantages))
        out = fn(
            logp=logp,
            sampler_logp=sampler_logp,
            advantages=advantages,
            loss_mask=loss_mask,
            num_loss_tokens=num_loss_tokens,
            **kwargs,
        )
        if not isinstance(out, LossOutput):
            raise TypeError(f"loss function returned {type(out).__name__}, expected LossOutput")
        return out

    return loss_fn


def reduce_device() -> torch.device:
    """Device for collectives of small CPU-side values: NCCL only reduces CUDA tensors."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class TokenStats:
    """Additive per-batch statistics of the ratio (merged over micro-batches and ranks)."""

    num_tokens: torch.Tensor
    num_masked: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_sq_sum: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    kl_sum: torch.Tensor
    entropy_sum: torch.Tensor

    @staticmethod
    def empty() -> TokenStats:
        z = torch.zeros((), dtype=torch.float64)
        return TokenStats(
            z, z, z, z, torch.tensor(float("inf")).double(), torch.tensor(-float("inf")).double(), z, z
        )

    @staticmethod
    def of(logp, sampler_logp, loss_mask, masked, entropy) -> TokenStats:
        with torch.no_grad():  # statistics live on the CPU (a few scalars per micro-batch)
            log_ratio = (logp - sampler_logp)[loss_mask].double().cpu()
            rho = torch.exp(log_ratio)
            stats = TokenStats.empty()
            if rho.numel() == 0:
                return stats
            return TokenStats(
                num_tokens=torch.tensor(float(rho.numel()), dtype=torch.float64),
                num_masked=masked[loss_mask].sum().double().cpu(),
                ratio_sum=rho.sum(),
                ratio_sq_sum=rho.pow(2).sum(),
                ratio_min=rho.min(),
                ratio_max=rho.max(),
                # k3 estimator of KL(mu || pi_theta) on tokens sampled from mu: rho - 1 - log rho >= 0
                kl_sum=(rho - 1 - log_ratio).sum(),
                entropy_sum=entropy[loss_mask].double().sum().cpu(),
            )

    def merge(self, other: TokenStats) -> TokenStats:
        return TokenStats(
            self.num_tokens + other.num_tokens,
            self.num_masked + other.num_masked,
            self.ratio_sum + other.ratio_sum,
            self.ratio_sq_sum + other.ratio_sq_sum,
            torch.minimum(self.ratio_min, other.ratio_min),
            torch.maximum(self.ratio_max, other.ratio_max),
            self.kl_sum + other.kl_sum,
            self.entropy_sum + other.entropy_sum,
        )

    def all_reduce(self) -> TokenStats:
        """Merge across data-parallel ranks (no-op without a process group)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        device = reduce_device()
        sums = torch.stack(
            [
                self.num_tokens,
                self.num_masked,
                self.ratio_sum,
                self.ratio_sq_sum,
                self.kl_sum,
                self.entropy_sum,
            ]
        )
        sums, mn, mx = sums.to(device), self.ratio_min.to(device), self.ratio_max.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(mn, op=dist.ReduceOp.MIN)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        sums, mn, mx = sums.cpu(), mn.cpu(), mx.cpu()
        return TokenStats(sums[0], sums[1], sums[2], sums[3], mn, mx, sums[4], sums[5])

    def metrics(self) -> dict[str, float]:
        n = max(float(self.num_tokens), 1.0)
        mean = float(self.ratio_sum) / n
        var = max(float(self.ratio_sq_sum) / n - mean**2, 0.0)
        return {
            "mismatch_kl": float(self.kl_sum) / n,
            "ratio/mean": mean,
            "ratio/std": var**0.5,
            "ratio/min": float(self.ratio_min) if self.num_tokens > 0 else 0.0,
            "ratio/max": float(self.ratio_max) if self.num_tokens > 0 else 0.0,
            "masked_fraction": float(self.num_masked) / n,
            "entropy": float(self.entropy_sum) / n,
        }
