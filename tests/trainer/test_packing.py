"""Packed micro-batches: position_ids restarting per sample give exactly the per-sample logprobs; the
logsumexp gather equals log_softmax + gather; a loss mask restricts the LM head to loss rows only."""

from __future__ import annotations

import pytest
import torch

from prime_async.trainer.packed_rows import logprobs_from_logits, packed_logprobs


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_per_sample(model, temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    lens = [7, 12, 5, 9]
    samples = [torch.randint(0, 1000, (n,), generator=g) for n in lens]
    ids = torch.cat(samples)
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        packed_logp, packed_ent = packed_logprobs(model, ids, pos, temperature)
        start = 0
        for s in samples:
            logp, ent = packed_logprobs(model, s, torch.arange(len(s)), temperature)
            torch.testing.assert_close(
                packed_logp[start + 1 : start + len(s)], logp[1:], rtol=1e-5, atol=1e-5
            )
            torch.testing.assert_close(packed_ent[start + 1 : start + len(s)], ent[1:], rtol=1e-5, atol=1e-5)
            start += len(s)
        # sanity: without restarting positions, later samples would see earlier ones and differ
        leaky, _ = packed_logprobs(model, ids, torch.arange(len(ids)), temperature)
        assert not torch.allclose(leaky[lens[0] + 1 :], packed_logp[lens[0] + 1 :], atol=1e-4)


def test_logprobs_match_manual_temperature(model) -> None:
    ids = torch.randint(0, 1000, (10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp, _ = packed_logprobs(model, ids, torch.arange(10), 0.5)
        logits = model(input_ids=ids[None]).logits[0]
        ref = torch.log_softmax(logits[:-1] / 0.5, -1).gather(-1, ids[1:, None])[:, 0]
    torch.testing.assert_close(logp[1:], ref)
    assert logp[0] == 0


def _log_softmax_gather(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, targets[:, None])[:, 0], -(logprobs.exp() * logprobs).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_gather_equals_log_softmax_gather_on_a_real_vocab(temperature: float) -> None:
    g = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(64, 49152, generator=g)).requires_grad_()  # SmolLM2's vocab, logit scale
    targets = torch.randint(0, 49152, (64,), generator=g)
    weights = torch.randn(64, generator=g)
    logp, entropy = logprobs_from_logits(logits, targets, temperature)
    (logp * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    ref_logp, _ = _log_softmax_gather(logits, targets, temperature)
    (ref_logp * weights).sum().backward()
    # |logp| ~ 15 here: fp32 rounding of the 49152-term logsumexp is ~1e-6 relative
    torch.testing.assert_close(logp, ref_logp, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-6)
    # the entropy sums 49152 terms: both fp32 forms are ~2e-5 off the float64 value (relative ~5e-6)
    exact_logp, exact_entropy = _log_softmax_gather(logits.detach().double(), targets, temperature)
    torch.testing.assert_close(logp.double(), exact_logp, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(entropy.double(), exact_entropy, rtol=1e-5, atol=0)
    assert not entropy.requires_grad


def test_loss_mask_restricts_the_lm_head_to_loss_rows(model) -> None:
    ids = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(10), torch.arange(14)])
    mask = (pos >= 4) & (pos < 9)  # a prompt, then 5 sampled tokens, per sample
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    try:
        full, full_ent = packed_logprobs(model, ids, pos, 0.8)
        (full * mask).sum().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        masked, masked_ent = packed_logprobs(model, ids, pos, 0.8, loss_mask=mask)
        masked.sum().backward()
    finally:
        hook.remove()
    assert seen == [23, int(mask.sum())]  # T - 1 rows without a mask, only the loss rows with it
    torch.testing.assert_close(masked[mask], full[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(masked_ent[mask], full_ent[mask], rtol=0, atol=1e-5)
    assert not masked[~mask].any() and not masked_ent[~mask].any()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)
