"""Importance-ratio losses (token- and sequence-level), as pure functions of per-token tensors.

Every loss sees one packed micro-batch as flat (T,) tensors:
    logp           log pi_theta(a_t) at the sampling temperature (requires grad); defined on loss tokens
                   only (the trainer runs the LM head only where it predicts one), 0 elsewhere
    sampler_logp   log mu(a_t) recorded by the sampler (the behaviour policy, token by token)
    advantages     A_t (group-relative advantage of the token's sample)
    loss_mask      True exactly on sampled tokens
    sample_ids     index of the token's packed sample in the row (`packed_rows.sample_ids`: a sample starts
                   where position_ids is 0); sequence-level losses group tokens by it
    num_loss_tokens  loss tokens of the normalizing set: the whole batch (all micro-batches, all ranks), or
                   the mini-batch when `optim.num_steps_per_batch` > 1
and returns `LossOutput(loss, masked)`: `loss` is this micro-batch's share of the batch loss, i.e. a sum
over its tokens divided by `num_loss_tokens`, so summing over micro-batches (and ranks) gives the batch
loss; `masked` marks loss tokens the trust region removed from the gradient. A sample never spans two
micro-batches, so a sequence-level loss sees each sample whole.

With rho_t = exp(logp - sampler_logp), every built-in loss has gradient -A_t * grad(logp) / N on-policy
(rho_t = 1), i.e. the policy gradient. Variants:
- `mask` (default, IcePop / DPPO-mask style): tokens with rho_t outside [ratio_low, ratio_high] get no
  gradient; the rest contribute -rho_t * A_t.
- `ppo_clip`: -min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t); "masked" = clip active.
- `m2po`: drop the tokens with the largest (log rho_t)^2 until the mean of (log rho_t)^2 over the kept
  loss tokens of each sample is <= m2_threshold (Zheng et al. 2025 bound the batch's second moment; a
  per-micro-batch bound made a token's fate depend on which samples were packed beside it, so the bound
  is per sample: the same tokens are kept however rows are packed); kept tokens contribute -rho_t * A_t.
- `tis` (truncated IS, Yao et al. 2025): -sg(min(rho_t, cap)) A_t logp_t; nothing is masked.
- `cispo` (MiniMax-M1 2025): -sg(clip(rho_t, 1-eps_low, 1+eps_high)) A_t logp_t; nothing is masked.
- `gspo` (Zheng et al. 2025): ppo_clip's objective with the sequence ratio s_i = exp(mean_t log rho_t)
  of the token's sample i in place of rho_t (differentiable); "masked" = clip active, per sample. Tokens
  are summed, so the sequence objective is weighted by its loss tokens (token-mean, not seq-mean).
- `mis` (Seq-MIS, Liu et al. 2025): samples whose prod_t rho_t leaves [ratio_low, ratio_high] are
  masked; kept tokens contribute -sg(prod_t rho_t) A_t logp_t.
- `custom`: a function with the `LossFn` signature, loaded from `loss.import_path` (it gets `sample_ids`
  when its signature names it or takes **kwargs).
("-w logp" above stands for -w * exp(logp - sg(logp)): the same gradient, and the value -w A_t.)

Invariants:
- non-finite inputs (logp, sampler logprobs or advantages on loss tokens) raise `NonFiniteError` before any
  loss is formed;
- tokens without gradient (masked, dropped, non-loss) never reach `exp` with their log-ratio: it is
  replaced by 0 first, so a huge log-ratio on such a token (exp overflows above ~88 in float32) leaves the
  loss and every gradient finite and unchanged (a custom loss must follow the same rule); detached weights
  are finite on every token (truncated, clipped, or exp of a masked-to-0 log-ratio);
- every tensor a loss creates lives on its inputs' device.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from prime_async.config.trainer import CustomLossConfig, LossConfig

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
        sample_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> LossOutput: ...


def check_finite(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, loss_mask) -> None:
    """Raise `NonFiniteError` naming the input that holds NaN/inf on a loss token."""
    for name, t in (("logp", logp), ("sampler_logprobs", sampler_logp), ("advantages", advantages)):
        bad = ~torch.isfinite(t.detach()) & loss_mask
        if bool(bad.any()):
            raise NonFiniteError(f"{name} is NaN/inf on {int(bad.sum())} loss token(s)")


def _live_ratio(log_ratio: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) on `live` tokens, 1 elsewhere. The mask is applied before `exp`: a token dropped
    afterwards (by indexing or `where`) still gets exp's backward, and 0 * exp(89.) = 0 * inf = NaN."""
    return torch.exp(torch.where(live, log_ratio, torch.zeros_like(log_ratio)))


def mask_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, ratio_low, ratio_high
) -> LossOutput:
    log_ratio = logp - sampler_logp
    rho_d = torch.exp(log_ratio.detach())  # may overflow to inf: only compared, never differentiated
    masked = loss_mask & ((rho_d < ratio_low) | (rho_d > ratio_high))
    keep = loss_mask & ~masked
    loss = -(_live_ratio(log_ratio, keep) * advantages)[keep].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=masked)


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages, loss_mask, num_loss_tokens, clip_low, clip_high
) -> LossOutput:
    """-min(r A, clip(r, 1-clip_low, 1+clip_high) A) per loss token, r = exp(log_ratio) (differentiable);
    "masked" = clip active (a constant term, no gradient)."""
    r_d = torch.exp(log_ratio.detach())  # may overflow to inf: only compared, never differentiated
    clipped_d = torch.clamp(r_d, 1 - clip_low, 1 + clip_high) * advantages
    masked = loss_mask & (clipped_d < r_d * advantages)
    # A = 0 tokens contribute 0 either way; excluding them keeps inf * 0 out of the forward pass.
    r = _live_ratio(log_ratio, loss_mask & ~masked & (advantages != 0))
    live_term = -torch.minimum(r * advantages, torch.clamp(r, 1 - clip_low, 1 + clip_high) * advantages)
    per_token = torch.where(masked, -clipped_d, live_term)
    loss = per_token[loss_mask].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=masked)


def ppo_clip_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, clip_low, clip_high
) -> LossOutput:
    return clipped_surrogate(logp - sampler_logp, advantages, loss_mask, num_loss_tokens, clip_low, clip_high)


def m2po_keep_mask(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    m2_threshold: float,
    sample_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep each sample's loss tokens with the smallest (log rho)^2 such that their mean is <=
    m2_threshold (no `sample_ids`: the row is one sample)."""
    sq = log_ratio.detach().pow(2)
    keep = torch.zeros_like(loss_mask)
    samples = (
        [loss_mask] if sample_ids is None else [loss_mask & (sample_ids == i) for i in sample_ids.unique()]
    )
    for tokens in samples:
        idx = torch.nonzero(tokens, as_tuple=True)[0]
        if idx.numel() == 0:
            continue
        sorted_sq, order = torch.sort(sq[idx])
        counts = torch.arange(1, idx.numel() + 1, dtype=sq.dtype, device=sq.device)
        prefix_mean = torch.cumsum(sorted_sq, 0) / counts
        num_keep = int((prefix_mean <= m2_threshold).sum())  # prefix means of sorted values never fall
        keep[idx[order[:num_keep]]] = True
    return keep


def m2po_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, m2_threshold, sample_ids=None
) -> LossOutput:
    log_ratio = logp - sampler_logp
    keep = m2po_keep_mask(log_ratio, loss_mask, m2_threshold, sample_ids)
    loss = -(_live_ratio(log_ratio, keep) * advantages)[keep].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=loss_mask & ~keep)


def weighted_policy_gradient(logp, weight, advantages, keep, num_loss_tokens) -> torch.Tensor:
    """sum over `keep` of -w_t A_t exp(logp_t - sg(logp_t)) / N: value -w A, gradient -w A grad(logp).
    `weight` is detached and must be finite on every token (a dropped token's backward is 0 * weight)."""
    unit = torch.exp(logp - logp.detach())  # exactly 1, with the gradient of logp
    return -(weight.detach() * advantages * unit)[keep].sum() / num_loss_tokens


def tis_loss(*, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, cap) -> LossOutput:
    weight = torch.clamp(torch.exp((logp - sampler_logp).detach()), max=cap)  # inf -> cap
    loss = weighted_policy_gradient(logp, weight, advantages, loss_mask, num_loss_tokens)
    return LossOutput(loss=loss, masked=torch.zeros_like(loss_mask))


def cispo_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, clip_low, clip_high
) -> LossOutput:
    weight = torch.clamp(torch.exp((logp - sampler_logp).detach()), 1 - clip_low, 1 + clip_high)
    loss = weighted_policy_gradient(logp, weight, advantages, loss_mask, num_loss_tokens)
    return LossOutput(loss=loss, masked=torch.zeros_like(loss_mask))


def per_sample_log_ratio(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, sample_ids: torch.Tensor, *, mean: bool
) -> torch.Tensor:
    """(T,): for every token, the sum (or mean) of log_ratio over its sample's loss tokens.
    Differentiable; a sample without loss tokens gets 0."""
    num_samples = int(sample_ids.max()) + 1 if sample_ids.numel() else 0
    zeros = torch.zeros(num_samples, dtype=log_ratio.dtype, device=log_ratio.device)
    live = torch.where(loss_mask, log_ratio, torch.zeros_like(log_ratio))
    per_sample = zeros.index_add(0, sample_ids, live)
    if mean:
        counts = zeros.index_add(0, sample_ids, loss_mask.to(log_ratio.dtype))
        per_sample = per_sample / counts.clamp(min=1)
    return per_sample[sample_ids]


def gspo_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, sample_ids, clip_low, clip_high
) -> LossOutput:
    seq_log_ratio = per_sample_log_ratio(logp - sampler_logp, loss_mask, sample_ids, mean=True)
    return clipped_surrogate(seq_log_ratio, advantages, loss_mask, num_loss_tokens, clip_low, clip_high)


def mis_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, sample_ids, ratio_low, ratio_high
) -> LossOutput:
    seq_log_ratio = per_sample_log_ratio((logp - sampler_logp).detach(), loss_mask, sample_ids, mean=False)
    keep = loss_mask & (seq_log_ratio >= math.log(ratio_low)) & (seq_log_ratio <= math.log(ratio_high))
    weight = torch.exp(torch.where(keep, seq_log_ratio, torch.zeros_like(seq_log_ratio)))
    loss = weighted_policy_gradient(logp, weight, advantages, keep, num_loss_tokens)
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


def _accepts_sample_ids(fn: LossFn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins / C callables without a signature
        return False
    return any(p.name == "sample_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


SampleIds = Literal["none", "passed", "required"]
"""Whether a loss gets the tokens' `sample_ids`: never, when given, or always (a sequence-level loss,
which refuses to run without them)."""


@dataclass(frozen=True)
class LossVariant:
    """A built-in loss: its function and how it sees samples. Its hyper-parameters are the fields of its
    config class other than `type`, passed by name (the config field names are the function's keywords)."""

    fn: LossFn
    sample_ids: SampleIds = "none"


LOSSES: dict[str, LossVariant] = {
    "mask": LossVariant(mask_loss),
    "ppo_clip": LossVariant(ppo_clip_loss),
    "m2po": LossVariant(m2po_loss, sample_ids="passed"),
    "tis": LossVariant(tis_loss),
    "cispo": LossVariant(cispo_loss),
    "gspo": LossVariant(gspo_loss, sample_ids="required"),
    "mis": LossVariant(mis_loss, sample_ids="required"),
}
"""Every built-in `loss.type` -> its variant; `custom` (a function by import path) is the one other type.
Adding a loss: its config class in the `LossConfig` union (config/trainer.py) and its entry here."""


def _bind(cfg: LossConfig) -> tuple[LossFn, dict[str, Any], SampleIds]:
    """The configured variant's function, hyper-parameters and use of `sample_ids`."""
    if isinstance(cfg, CustomLossConfig):
        fn = load_custom_loss(cfg.import_path)
        return fn, dict(cfg.kwargs), "passed" if _accepts_sample_ids(fn) else "none"
    variant = LOSSES[cfg.type]
    return variant.fn, cfg.model_dump(exclude={"type"}), variant.sample_ids


def build_loss_fn(cfg: LossConfig) -> LossFn:
    """Bind the configured variant's hyper-parameters: returns a `LossFn`."""
    fn, kwargs, sample_ids = _bind(cfg)
    needs_samples = sample_ids == "required"
    passes_samples = sample_ids != "none"

    def loss_fn(*, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, sample_ids=None) -> LossOutput:
        if num_loss_tokens < 1:
            raise ValueError(
                "num_loss_tokens must be >= 1 (a batch without sampled tokens cannot be trained)"
            )
        if needs_samples and (sample_ids is None or sample_ids.shape != logp.shape):
            raise ValueError(f"loss.type = {cfg.type!r} is sequence-level: it needs sample_ids of shape (T,)")
        check_finite(logp, sampler_logp, advantages, loss_mask)
        # Non-loss positions may hold placeholders; zero them so they cannot leak NaN into gradients.
        sampler_logp = torch.where(loss_mask, sampler_logp, logp.detach())
        advantages = torch.where(loss_mask, advantages, torch.zeros_like(advantages))
        extra = {"sample_ids": sample_ids} if passes_samples else {}
        out = fn(
            logp=logp,
            sampler_logp=sampler_logp,
            advantages=advantages,
            loss_mask=loss_mask,
            num_loss_tokens=num_loss_tokens,
            **extra,
            **kwargs,
        )
        if not isinstance(out, LossOutput):
            raise TypeError(f"loss function returned {type(out).__name__}, expected LossOutput")
        return out

    return loss_fn


def nll_loss(
    *, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, sample_ids=None, **_: Any
) -> LossOutput:
    """Supervised fine-tuning (`sft`): the mean negative log-likelihood of the loss tokens, -sum(logp) / N.
    Sampler logprobs and advantages are not used (SFT data was not sampled); nothing is masked. Its
    gradient equals the on-policy policy gradient with A_t = 1, so both share every backend's code path."""
    if num_loss_tokens < 1:
        raise ValueError("num_loss_tokens must be >= 1 (a batch without trained tokens cannot be trained)")
    bad = ~torch.isfinite(logp.detach()) & loss_mask
    if bool(bad.any()):
        raise NonFiniteError(f"logp is NaN/inf on {int(bad.sum())} loss token(s)")
    loss = -logp[loss_mask].sum() / num_loss_tokens
    return LossOutput(loss=loss, masked=torch.zeros_like(loss_mask))
