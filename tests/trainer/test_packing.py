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


def _group_rows(prompt: torch.Tensor, completions: list[torch.Tensor], shared: int):
    """The same group packed unshared (every sample whole) and shared (first whole, then branches from
    token `shared` on), as (ids, positions, loss mask) each."""
    whole = [torch.cat([prompt, c]) for c in completions]
    mask_of = [torch.arange(len(w)) >= len(prompt) for w in whole]
    plain = (torch.cat(whole), torch.cat([torch.arange(len(w)) for w in whole]), torch.cat(mask_of))
    ids = [whole[0]] + [w[shared:] for w in whole[1:]]
    pos = [torch.arange(len(whole[0]))] + [torch.arange(shared, len(w)) for w in whole[1:]]
    masks = [mask_of[0]] + [m[shared:] for m in mask_of[1:]]
    return plain, (torch.cat(ids), torch.cat(pos), torch.cat(masks))


def test_shared_prefix_row_equals_unshared_row(model) -> None:
    """A group packed as one shared prompt + branches gives the loss tokens of the unshared packing the
    same logprobs, entropies and parameter gradients; an unrelated sample packed after it is untouched."""
    from prime_async.trainer.packed_rows import has_branches

    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 1000, (11,), generator=g)
    completions = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 3, 7)]
    other = torch.randint(0, 1000, (9,), generator=g)  # a second sample (another group) in the same row
    weights = torch.randn(64, generator=g)
    plain, shared = _group_rows(prompt, completions, shared=len(prompt) - 1)
    results = []
    for ids, pos, mask in (plain, shared):
        ids, pos = torch.cat([ids, other]), torch.cat([pos, torch.arange(9)])
        mask = torch.cat([mask, torch.arange(9) >= 4])
        logp, ent = packed_logprobs(model, ids, pos, 0.9, loss_mask=mask)
        (logp[mask] * weights[: int(mask.sum())]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        results.append((logp[mask].detach(), ent[mask], grads, has_branches(pos), len(ids)))
    (logp_a, ent_a, grads_a, branched_a, len_a), (logp_b, ent_b, grads_b, branched_b, len_b) = results
    assert not branched_a and branched_b and len_b == len_a - 2 * (len(prompt) - 1)
    torch.testing.assert_close(logp_b, logp_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=1e-5)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5)  # summation order differs


def test_branches_do_not_see_each_other(model) -> None:
    """Changing one branch's tokens changes no other branch's logprobs (nor the first sample's)."""
    from prime_async.trainer.packed_rows import sample_starts

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 1000, (8,), generator=g)
    completions = [torch.randint(0, 1000, (6,), generator=g) for _ in range(3)]
    _, (ids, pos, _) = _group_rows(prompt, completions, shared=7)
    changed = ids.clone()
    second = slice(len(prompt) + 6, len(prompt) + 6 + 7)  # the second sample's branch
    changed[second] = torch.randint(0, 1000, (7,), generator=g)
    with torch.no_grad():
        before, _ = packed_logprobs(model, ids, pos, 1.0)
        after, _ = packed_logprobs(model, changed, pos, 1.0)
    untouched = ~sample_starts(pos)  # a sample's first token is predicted from no context of its own
    untouched[second] = False
    torch.testing.assert_close(after[untouched], before[untouched], rtol=0, atol=1e-6)
    assert not torch.allclose(after[second], before[second], atol=1e-4)


def test_check_micro_batch_refuses_a_branch_longer_than_its_prefix() -> None:
    import numpy as np

    from prime_async.trainer.packed_rows import check_micro_batch
    from prime_async.transport.types import MicroBatch

    def row(positions: list[int], loss: list[bool]) -> MicroBatch:
        n = len(positions)
        return MicroBatch(
            input_ids=np.arange(n, dtype=np.int32), position_ids=np.asarray(positions, dtype=np.int32),
            loss_mask=np.asarray(loss), advantages=np.zeros(n, np.float32),
            sampler_logprobs=np.zeros(n, np.float32), token_versions=np.full(n, -1, np.int32),
        )  # fmt: skip

    check_micro_batch(row([0, 1, 2, 3, 2, 3], [False, False, False, True, False, True]), 64, 7)
    with pytest.raises(ValueError, match="batch 7: branch at token 3 continues 5 shared tokens"):
        check_micro_batch(row([0, 1, 2, 5, 6], [False] * 5), 64, 7)
    with pytest.raises(ValueError, match="loss token at a sample's first token"):
        check_micro_batch(row([0, 1, 2, 3, 2, 3], [False, False, False, True, True, True]), 64, 7)
