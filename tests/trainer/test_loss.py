"""Loss functions against plain reference computations (token-level and sequence-level, packed rows)."""

from __future__ import annotations

import inspect
import sys
import types
import typing

import numpy as np
import pytest
import torch

from prime_async.config.trainer import (
    CISPOLossConfig,
    CustomLossConfig,
    GSPOLossConfig,
    LossConfig,
    M2POLossConfig,
    MaskLossConfig,
    MISLossConfig,
    PPOClipLossConfig,
    TISLossConfig,
)
from prime_async.trainer.loss import LOSSES, LossOutput, NonFiniteError, build_loss_fn, m2po_keep_mask
from prime_async.trainer.packed_rows import sample_ids as packed_sample_ids
from prime_async.trainer.token_stats import TokenStats

ALL = [
    MaskLossConfig(),
    PPOClipLossConfig(),
    M2POLossConfig(),
    TISLossConfig(),
    CISPOLossConfig(),
    GSPOLossConfig(),
    MISLossConfig(),
]
NO_MASK = ("tis", "cispo")  # truncate / clip the weight, never remove a token's gradient
SAMPLE_LENS = (5, 5, 6)  # the default packed row: three samples


def _positions(lens) -> np.ndarray:
    return np.concatenate([np.arange(n) for n in lens])


def _sample_ids(lens) -> torch.Tensor:
    return torch.from_numpy(packed_sample_ids(_positions(lens)))


def _inputs(seed: int = 0, lens=SAMPLE_LENS):
    """A packed row: a sample's first token is never a loss token; one advantage per sample."""
    t = sum(lens)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, 8, generator=g)
    actions = torch.randint(0, 8, (t,), generator=g)
    mask = (torch.rand(t, generator=g) > 0.3) & torch.from_numpy(_positions(lens) != 0)
    adv = torch.randn(len(lens), generator=g)[_sample_ids(lens)]
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
        logp=logp,
        sampler_logp=logp.detach(),
        advantages=adv,
        loss_mask=mask,
        num_loss_tokens=num_loss_tokens,
        sample_ids=_sample_ids(SAMPLE_LENS),
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


def test_m2po_keeps_the_same_tokens_however_rows_are_packed() -> None:
    """Regression: m2po bounded the second moment per micro-batch, so sample B's tokens (log rho 0.3,
    mean square 0.09 > 0.04) were dropped alone but kept when packed beside on-policy sample A (the
    packed mean 0.03 <= 0.04): a token's fate depended on its neighbours. Now the bound is per sample."""
    a, b = torch.zeros(4), torch.full((2,), 0.3)
    mask = torch.ones(6, dtype=torch.bool)
    packed = m2po_keep_mask(torch.cat([a, b]), mask, 0.04, torch.tensor([0, 0, 0, 0, 1, 1]))
    alone = torch.cat([m2po_keep_mask(a, mask[:4], 0.04), m2po_keep_mask(b, mask[4:], 0.04)])
    assert packed.tolist() == alone.tolist() == [True] * 4 + [False] * 2
    fn = build_loss_fn(M2POLossConfig(m2_threshold=0.04))
    out = fn(logp=torch.cat([a, b]), sampler_logp=torch.zeros(6), advantages=torch.ones(6), loss_mask=mask,
             num_loss_tokens=6, sample_ids=torch.tensor([0, 0, 0, 0, 1, 1]))  # fmt: skip
    assert out.masked.tolist() == [False] * 4 + [True] * 2


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_normalized_by_batch_loss_tokens(cfg) -> None:
    """Two micro-batches with the batch normalizer sum to the loss of the concatenated batch (a sample
    never spans two micro-batches: the split is at a sample boundary)."""
    lens = (10, 6, 8)
    logits, actions, mask, adv = _inputs(1, lens)
    logp = _logp(logits, actions)
    sampler = logp + 0.01 * torch.randn(24, generator=torch.Generator().manual_seed(2))
    ids = _sample_ids(lens)
    n = int(mask.sum())
    fn = build_loss_fn(cfg)

    def loss(s: slice, num_loss_tokens: int) -> torch.Tensor:
        return fn(
            logp=logp[s],
            sampler_logp=sampler[s],
            advantages=adv[s],
            loss_mask=mask[s],
            num_loss_tokens=num_loss_tokens,
            sample_ids=ids[s] - ids[s][0],
        ).loss

    whole = loss(slice(None), n)
    parts = loss(slice(0, 10), n) + loss(slice(10, 24), n)
    torch.testing.assert_close(parts, whole)  # m2po too: its bound is per sample, not per micro-batch
    torch.testing.assert_close(loss(slice(None), 2 * n) * 2, whole)


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
        build_loss_fn(cfg)(loss_mask=mask, num_loss_tokens=10, sample_ids=_sample_ids(SAMPLE_LENS), **kw)


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


def _loss_and_grad(cfg, logits, actions, mask, adv, sampler_logp):
    x = logits.clone().requires_grad_()
    out = build_loss_fn(cfg)(
        logp=_logp(x, actions),
        sampler_logp=sampler_logp,
        advantages=adv,
        loss_mask=mask,
        num_loss_tokens=20,
        sample_ids=_sample_ids(SAMPLE_LENS).to(logits.device),
    )
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_huge_log_ratio_on_masked_token_is_harmless(cfg) -> None:
    """Regression: exp was taken on every token and masked ones dropped afterwards, so a log-ratio above
    ~88 (exp overflows in float32) on a masked token gave 0 * inf = NaN in the backward pass. tis and
    cispo mask nothing: their weight is capped, so both ratios give the same result too."""
    logits, actions, mask, adv = _inputs(3)
    logp = _logp(logits, actions).detach()
    t = int(torch.nonzero(mask)[0])
    ids = _sample_ids(SAMPLE_LENS)
    adv[ids == ids[t]] = 1.5  # A > 0 on t's sample: the clip of ppo_clip / gspo is active for a large ratio
    results = []
    for log_ratio in (10.0, 100.0):  # rho = 2.2e4 (masked, finite) vs rho = inf in float32 (masked)
        sampler = logp.clone()
        sampler[t] = logp[t] - log_ratio
        out, grad = _loss_and_grad(cfg, logits, actions, mask, adv, sampler)
        assert bool(out.masked[t]) != (cfg.type in NO_MASK), "every built-in trust region masks it"
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all(), f"log-ratio {log_ratio}"
        results.append((out.loss.detach(), grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])


def test_ppo_clip_zero_advantage_huge_ratio_is_finite() -> None:
    logits, actions, mask, adv = _inputs(4)
    logp = _logp(logits, actions).detach()
    t = int(torch.nonzero(mask)[0])
    adv[t] = 0.0
    sampler = logp.clone()
    sampler[t] = logp[t] - 100.0
    out, grad = _loss_and_grad(PPOClipLossConfig(), logits, actions, mask, adv, sampler)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_loss_creates_tensors_on_the_inputs_device(cfg) -> None:
    """Regression (m2po on CUDA): a tensor created without `device=` lands on the default device, not the
    inputs'. With the default device set to `meta`, any such tensor meets the CPU inputs and raises."""
    logits, actions, mask, adv = _inputs(5)
    x = logits.clone().requires_grad_()
    logp = _logp(x, actions)
    sampler = logp.detach() + 0.1 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(6))
    with torch.device("meta"):
        out = build_loss_fn(cfg)(
            logp=logp,
            sampler_logp=sampler,
            advantages=adv,
            loss_mask=mask,
            num_loss_tokens=20,
            sample_ids=_sample_ids(SAMPLE_LENS),
        )
        out.loss.backward()
    assert out.loss.device.type == "cpu" and out.masked.device.type == "cpu"
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_loss_on_cuda_matches_cpu(cfg) -> None:
    """The same regression on a real non-CPU device (skipped without CUDA)."""
    logits, actions, mask, adv = _inputs(7)
    noise = torch.randn(len(actions), generator=torch.Generator().manual_seed(8))
    sampler = _logp(logits, actions) + 0.1 * noise
    results = []
    for device in ("cpu", "cuda"):
        out, grad = _loss_and_grad(
            cfg, logits.to(device), actions.to(device), mask.to(device), adv.to(device), sampler.to(device)
        )
        assert out.loss.device.type == device
        results.append((out.loss.detach().cpu(), grad.cpu()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


def _fn_on(cfg, logp, sampler, adv, mask, lens, num_loss_tokens):
    return build_loss_fn(cfg)(
        logp=logp,
        sampler_logp=sampler,
        advantages=adv,
        loss_mask=mask,
        num_loss_tokens=num_loss_tokens,
        sample_ids=_sample_ids(lens),
    )


def test_sample_ids_restart_where_position_ids_do() -> None:
    assert packed_sample_ids(np.array([0, 1, 2, 0, 1, 0, 0, 1])).tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    assert packed_sample_ids(np.array([3, 4, 0, 1])).tolist() == [0, 0, 1, 1]  # a row starts a sample
    assert packed_sample_ids(np.array([], dtype=np.int32)).tolist() == []


def test_tis_reference_gradient() -> None:
    rho = [0.5, 1.0, 1.9, 3.0, 1e30]
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, -0.5])
    logp, sampler = _ratios(rho)
    mask = torch.tensor([True, True, True, True, False])
    out = build_loss_fn(TISLossConfig(cap=2.0))(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=8
    )
    out.loss.backward()
    weight = torch.tensor([0.5, 1.0, 1.9, 2.0, 0.0])  # min(rho, 2); the last is not a loss token
    torch.testing.assert_close(logp.grad, -weight * adv / 8)
    torch.testing.assert_close(out.loss, -(weight * adv).sum() / 8)
    assert not out.masked.any()


def test_cispo_reference_gradient() -> None:
    rho = [0.5, 0.9, 1.1, 1.5, 3.0]
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0])
    logp, sampler = _ratios(rho)
    mask = torch.ones(5, dtype=torch.bool)
    out = build_loss_fn(CISPOLossConfig(clip_low=0.2, clip_high=0.28))(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=5
    )
    out.loss.backward()
    weight = torch.tensor([0.8, 0.9, 1.1, 1.28, 1.28])  # clip(rho, 0.8, 1.28), gradient through logp only
    torch.testing.assert_close(logp.grad, -weight * adv / 5)
    torch.testing.assert_close(out.loss, -(weight * adv).sum() / 5)
    assert not out.masked.any()
    # without a lower bound (the MiniMax-M1 default) cispo is tis with cap = 1 + clip_high
    tis = build_loss_fn(TISLossConfig(cap=1.28))(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=5
    )
    cispo = build_loss_fn(CISPOLossConfig(clip_low=1.0, clip_high=0.28))(
        logp=logp, sampler_logp=sampler, advantages=adv, loss_mask=mask, num_loss_tokens=5
    )
    torch.testing.assert_close(cispo.loss, tis.loss)


# A packed row of three samples (position_ids restart at 0): a prompt token, then loss tokens.
PACKED_LENS = (4, 3, 5)
PACKED_LOG_RATIO = [0.0, 0.01, 0.03, -0.01, 0.0, 0.2, 0.4, 0.0, -0.001, 0.0, 0.002, 0.0005]
PACKED_ADV = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, -2.0, -2.0, -2.0, -2.0]


def _packed_inputs():
    log_ratio = torch.tensor(PACKED_LOG_RATIO, dtype=torch.float64)
    mask = torch.from_numpy(_positions(PACKED_LENS) != 0)
    logp = (log_ratio - 1.0).requires_grad_()  # sampler logprob -1 everywhere
    return logp, torch.full_like(log_ratio, -1.0), torch.tensor(PACKED_ADV, dtype=torch.float64), mask


def test_gspo_reference_gradient_on_a_packed_row() -> None:
    """s_i = exp(mean log rho over sample i's loss tokens), band [0.98, 1.02]: sample 0 (s = exp(0.01))
    and sample 2 (s = exp(0.000375), A < 0) are inside, sample 1 (s = exp(0.3), A > 0) is clipped."""
    cfg = GSPOLossConfig(clip_low=0.02, clip_high=0.02)
    logp, sampler, adv, mask = _packed_inputs()
    out = _fn_on(cfg, logp, sampler, adv, mask, PACKED_LENS, num_loss_tokens=20)
    out.loss.backward()
    ref_logp = logp.detach().clone().requires_grad_()
    ref, masked, start = torch.zeros((), dtype=torch.float64), [], 0
    for n in PACKED_LENS:  # one sample at a time, from the definition
        tokens = slice(start + 1, start + n)  # the sample's loss tokens
        s_i = torch.exp((ref_logp[tokens] - sampler[tokens]).mean())
        a_i = adv[start + 1]
        term = torch.minimum(s_i * a_i, torch.clamp(s_i, 0.98, 1.02) * a_i)
        ref = ref - (n - 1) * term / 20
        masked += [False] + [bool(torch.clamp(s_i, 0.98, 1.02) * a_i < s_i * a_i)] * (n - 1)
        start += n
    ref.backward()
    assert out.masked.tolist() == masked == [False] * 5 + [True, True] + [False] * 5
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(logp.grad, ref_logp.grad)
    # gradient of an unclipped token: -s_i * A_i / N (the sequence gradient spread over the tokens)
    s_0 = torch.exp(torch.tensor(PACKED_LOG_RATIO[1:4], dtype=torch.float64).mean())
    torch.testing.assert_close(logp.grad[1], -s_0 * 1.0 / 20)


def test_mis_reference_gradient_on_a_packed_row() -> None:
    """prod rho per sample: exp(0.03) and exp(0.0015) are inside [0.9, 1.1], exp(0.6) is not."""
    cfg = MISLossConfig(ratio_low=0.9, ratio_high=1.1)
    logp, sampler, adv, mask = _packed_inputs()
    out = _fn_on(cfg, logp, sampler, adv, mask, PACKED_LENS, num_loss_tokens=20)
    out.loss.backward()
    expected_grad, masked, start = torch.zeros(12, dtype=torch.float64), [], 0
    for n in PACKED_LENS:
        tokens = slice(start + 1, start + n)
        w = float(torch.exp(torch.tensor(PACKED_LOG_RATIO[tokens]).double().sum()))
        kept = 0.9 <= w <= 1.1
        if kept:
            expected_grad[tokens] = -w * adv[tokens] / 20
        masked += [False] + [not kept] * (n - 1)
        start += n
    assert out.masked.tolist() == masked == [False] * 5 + [True, True] + [False] * 5
    torch.testing.assert_close(logp.grad, expected_grad)
    torch.testing.assert_close(out.loss, expected_grad.sum())  # the value is sum -w A / N, like the gradient


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: c.type)
def test_packed_row_equals_its_samples_one_by_one(cfg) -> None:
    """No loss mixes samples of one row: the packed row's loss and gradient are the sums over its samples
    computed alone (m2po included: its keep mask used to depend on the row's other samples)."""
    lens = (6, 4, 7, 5)
    logits, actions, mask, adv = _inputs(11, lens)
    sampler = _logp(logits, actions).detach() + 0.2 * torch.randn(
        22, generator=torch.Generator().manual_seed(3)
    )
    packed, packed_grad = _loss_and_grad_lens(cfg, logits, actions, mask, adv, sampler, lens)
    total, grads, start = torch.zeros(()), [], 0
    for n in lens:
        s = slice(start, start + n)
        out, grad = _loss_and_grad_lens(cfg, logits[s], actions[s], mask[s], adv[s], sampler[s], (n,))
        total, start = total + out.loss.detach(), start + n
        grads.append(grad)
    torch.testing.assert_close(packed.loss.detach(), total)
    torch.testing.assert_close(packed_grad, torch.cat(grads))


def _loss_and_grad_lens(cfg, logits, actions, mask, adv, sampler, lens):
    x = logits.clone().requires_grad_()
    out = _fn_on(cfg, _logp(x, actions), sampler, adv, mask, lens, num_loss_tokens=30)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("cfg", [GSPOLossConfig(), MISLossConfig()], ids=lambda c: c.type)
def test_sequence_loss_needs_sample_ids(cfg) -> None:
    logits, actions, mask, adv = _inputs()
    logp = _logp(logits, actions)
    with pytest.raises(ValueError, match="sequence-level: it needs sample_ids"):
        build_loss_fn(cfg)(logp=logp, sampler_logp=logp, advantages=adv, loss_mask=mask, num_loss_tokens=5)


@pytest.mark.parametrize("cfg", [GSPOLossConfig(), MISLossConfig()], ids=lambda c: c.type)
def test_sequence_ratio_overflow_is_masked_and_finite(cfg) -> None:
    """Every loss token of sample 1 at log-ratio 100: its sequence ratio overflows float32 (exp(100) and
    exp(400) = inf); the sample is masked, the other samples' loss and gradients are unchanged."""
    logits, actions, mask, adv = _inputs(6)
    ids = _sample_ids(SAMPLE_LENS)
    adv[ids == 1] = 1.0  # A > 0: gspo's clip is active for a huge ratio
    logp = _logp(logits, actions).detach()
    sampler = torch.where(ids == 1, logp - 100.0, logp)
    out, grad = _loss_and_grad(cfg, logits, actions, mask, adv, sampler)
    assert out.masked[mask & (ids == 1)].all() and not out.masked[ids != 1].any()
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert (grad[ids == 1] == 0).all()
    _, calm_grad = _loss_and_grad(cfg, logits, actions, mask & (ids != 1), adv, logp)
    torch.testing.assert_close(grad[ids != 1], calm_grad[ids != 1])


def test_custom_loss_gets_sample_ids_when_it_names_them() -> None:
    mod = types.ModuleType("my_sequence_loss")
    seen = {}

    def per_sample(*, logp, sampler_logp, advantages, loss_mask, num_loss_tokens, sample_ids):
        seen["ids"] = sample_ids.tolist()
        return LossOutput(
            loss=-(logp * advantages)[loss_mask].sum() / num_loss_tokens, masked=loss_mask & False
        )

    mod.per_sample = per_sample
    sys.modules["my_sequence_loss"] = mod
    logits, actions, mask, adv = _inputs()
    logp = _logp(logits, actions)
    _fn_on(CustomLossConfig(import_path="my_sequence_loss:per_sample"), logp, logp, adv, mask, SAMPLE_LENS, 5)
    assert seen["ids"] == _sample_ids(SAMPLE_LENS).tolist()


def test_token_stats_effective_steps() -> None:
    mask = torch.tensor([False, True, True, True])
    zeros = torch.zeros(4)
    s1 = TokenStats.of(zeros, zeros, mask, mask & False, zeros, np.array([9, 2, 4, 0]))
    s2 = TokenStats.of(zeros[:2], zeros[:2], mask[:2], mask[:2] & False, zeros[:2], np.array([0, 7]))
    m = s1.merge(s2).metrics()
    # loss tokens only: 2, 4, 0 and 7 (the non-loss 9 does not count)
    assert m["offpolicy/effective_steps/mean"] == pytest.approx(13 / 4)
    assert m["offpolicy/effective_steps/max"] == 7
    assert TokenStats.empty().metrics()["offpolicy/effective_steps/max"] == 0.0


def test_every_loss_config_has_one_registered_function_taking_its_fields() -> None:
    """`LOSSES` (keyed by `loss.type`) holds every built-in member of the `LossConfig` union, and each
    function takes its config's fields (other than `type`) by name; `custom` is the one other type."""
    members = typing.get_args(typing.get_args(LossConfig)[0])
    types_ = {cls.model_fields["type"].default: cls for cls in members}
    assert set(types_) == set(LOSSES) | {"custom"}
    for name, variant in LOSSES.items():
        fields = set(types_[name].model_fields) - {"type"}
        assert fields <= set(inspect.signature(variant.fn).parameters), name
