"""Loss functions against plain reference computations."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from prime_async.config.trainer import CustomLossConfig, M2POLossConfig, MaskLossConfig, PPOClipLossConfig
from prime_async.trainer.loss import LossOutput, NonFiniteError, TokenStats, build_loss_fn, m2po_keep_mask

ALL = [MaskLossConfig(), PPOClipLossConfig(), M2POLossConfig()]


def _inputs(seed: int = 0, t: int = 16):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, 8, generator=g)
    actions = torch.randint(0, 8, (t,), generator=g)
    mask = torch.rand(t, generator=g) > 0.3
    mask[0] = False
    adv = torch.randn(t, generator=g)
    return logits, actions, mask, adv


def _logp(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, actions[:, None])[:, 0]


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_on_policy_gradient_is_policy_gradient(cfg) -> None:
    logits, actions, mask, adv = _inputs()
    num_loss_tokens = 40  # the whole batch has more tokens than this micro-batch
    x = logits.clone().requires_grad_()
    logp = _logp(x, actions)
    out = build_loss_fn(cfg)(
        logp=logp, sampler_logp=logp.detach(), advantages=adv, loss_mask=mask, num_loss_tokens=num_loss_tokens
    )
    out.loss.backward()
    y = logits.clone().requires_grad_()
    ref = -(adv * _logp(y, actions))[mask].sum() / num_loss_tokens
    ref.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss, -adv[mask].sum() / num_loss_tokens)
    assert not out.masked.any()


def _ratios(rho: list[float]):
    sampler = torch.zeros(len(rho))
    logp = torch.log(torch.tensor(rho)).requires_grad_()
    return logp, sampler


def test_mask_thresholds_mask_exactly_outside_tokens() -> None:
    rho = [0.3, 0.49, 0.5, 1.0, 1.9, 2.0, 2.01, 5.0, 0.1]
    logp, sampler = _ratios(rho)
    mask = torch.tensor([True] * 8 + [False])
    adv = torch.ones(len(rho))
    out = build_loss_fn(MaskLossConfig(ratio_low=0.5, ratio_high=2.0))(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=10
    )
    assert out.masked.tolist() == [True, True, False, False, False, False, True, True, False]
    out.loss.backward()
    kept = torch.tensor([False, False, True, True, True, True, False, False, False])
    # d(-rho*A/N)/dlogp = -rho*A/N on kept tokens, 0 elsewhere
    expected = torch.where(kept, -torch.tensor(rho) / 10, torch.zeros(len(rho)))
    torch.testing.assert_close(logp.grad, expected)


def test_ppo_clip_zero_gradient_exactly_where_clipped() -> None:
    rho = [0.5, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0, 0.5]
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0])
    logp, sampler = _ratios(rho)
    mask = torch.ones(len(rho), dtype=torch.bool)
    out = build_loss_fn(PPOClipLossConfig(clip_low=0.2, clip_high=0.28))(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=8
    )
    out.loss.backward()
    # A>0: clip active above 1.28 only (below 0.8 the min picks the unclipped term); A<0: active below 0.8
    clipped = [False, False, False, False, False, True, True, True]
    assert out.masked.tolist() == clipped
    assert [bool(g == 0) for g in logp.grad] == clipped
    r = torch.tensor(rho)
    ref = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.28) * adv).sum() / 8
    torch.testing.assert_close(out.loss, ref)


def test_m2po_keeps_smallest_second_moment_tokens() -> None:
    log_ratio = torch.tensor([0.0, 0.1, -0.1, 0.3, -0.5, 1.0, 0.05])
    mask = torch.tensor([True, True, True, True, True, True, False])
    keep = m2po_keep_mask(log_ratio, mask, m2_threshold=0.04)
    # sorted squares 0, .01, .01, .09, .25, 1: prefix means 0, .005, .0067, .0275, .072 -> keep 4
    assert keep.tolist() == [True, True, True, True, False, False, False]
    assert log_ratio[keep].pow(2).mean() <= 0.04
    out = build_loss_fn(M2POLossConfig(m2_threshold=0.04))(
        logp=log_ratio.clone().requires_grad_(),
        sampler_logp=torch.zeros(7),
        advantages=torch.ones(7),
        loss_mask=mask,
        num_loss_tokens=6,
    )
    assert out.masked.tolist() == [False, False, False, False, True, True, False]


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_normalized_by_batch_loss_tokens(cfg) -> None:
    """Two micro-batches with the batch normalizer sum to the loss of the concatenated batch."""
    logits, actions, mask, adv = _inputs(1, t=24)
    logp = _logp(logits, actions)
    sampler = logp + 0.01 * torch.randn(24, generator=torch.Generator().manual_seed(2))
    n = int(mask.sum())
    fn = build_loss_fn(cfg)
    whole = fn(logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=n).loss
    parts = sum(
        fn(
            logp=logp[s], sampler_logp=sampler[s], advantages=adv[s], loss_mask=mask[s], num_loss_tokens=n
        ).loss
        for s in (slice(0, 10), slice(10, 24))
    )
    if cfg.type != "m2po":  # m2po's trust region is per micro-batch by design
        torch.testing.assert_close(parts, whole)
    half = fn(logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=2 * n).loss
    torch.testing.assert_close(half * 2, whole)


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
@pytest.mark.parametrize("field", ["logp", "sampler_logp", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_rejected(cfg, field, bad) -> None:
    logits, actions, mask, adv = _inputs()
    kw = {"logp": _logp(logits, actions), "sampler_logp": _logp(logits, actions), "advantages": adv}
    idx = int(torch.nonzero(mask)[0])
    kw[field] = kw[field].clone()
    kw[field][idx] = bad
    with pytest.raises(NonFiniteError, match="NaN/inf"):
        build_loss_fn(cfg)(loss_mask=mask, num_loss_tokens=10, **kw)


def test_non_finite_outside_loss_mask_is_ignored() -> None:
    logits, actions, mask, adv = _inputs()
    sampler = _logp(logits, actions).clone()
    sampler[0] = float("nan")  # prompt token: not a loss token
    logp = _logp(logits, actions).requires_grad_()
    out = build_loss_fn(MaskLossConfig())(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=10
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()


def test_custom_loss_by_import_path() -> None:
    mod = types.ModuleType("my_custom_loss")

    def reinforce(*, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, scale):
        return LossOutput(
            loss=-scale * (logp * advantages)[loss_mask].sum() / num_loss_tokens,
            masked=torch.zeros_like(loss_mask),
        )

    mod.reinforce = reinforce
    sys.modules["my_custom_loss"] = mod
    logits, actions, mask, adv = _inputs()
    logp = _logp(logits, actions)
    fn = build_loss_fn(CustomLossConfig(import_path="my_custom_loss:reinforce", kwargs={"scale": 2.0}))
    out = fn(logp=logp, sampler_logp=logp, advantages=adv, loss_mask=mask, num_loss_tokens=5)
    torch.testing.assert_close(out.loss, -2.0 * (logp * adv)[mask].sum() / 5)
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_loss_fn(CustomLossConfig(import_path="my_custom_loss:nope"))


def test_token_stats_reference() -> None:
    logp = torch.log(torch.tensor([0.5, 1.0, 2.0, 4.0]))
    mask = torch.tensor([True, True, True, False])
    masked = torch.tensor([True, False, False, False])
    s1 = TokenStats.of(logp[:2], torch.zeros(2), mask[:2], masked[:2], torch.ones(2))
    s2 = TokenStats.of(logp[2:], torch.zeros(2), mask[2:], masked[2:], torch.ones(2))
    m = s1.merge(s2).metrics()
    rho = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    assert m["ratio/mean"] == pytest.approx(rho.mean().item())
    assert m["ratio/std"] == pytest.approx(rho.std(unbiased=False).item())
    assert (m["ratio/min"], m["ratio/max"]) == pytest.approx((0.5, 2.0))
    assert m["masked_fraction"] == pytest.approx(1 / 3)
    assert m["mismatch_kl"] == pytest.approx((rho - 1 - rho.log()).mean().item())
    assert m["entropy"] == pytest.approx(1.0)
