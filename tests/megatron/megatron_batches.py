"""Deterministic packed micro-batches shared by the megatron worker and the FSDP reference in the tests."""

from __future__ import annotations

import numpy as np

from prime_async.transport.types import MicroBatch


def packed_row(rng: np.random.Generator, sample_lens: list[int], vocab: int) -> MicroBatch:
    """One packed row of samples: the first 3 tokens of each sample are prompt, the rest are loss tokens."""
    ids = np.concatenate([rng.integers(0, vocab, n) for n in sample_lens]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in sample_lens]).astype(np.int32)
    mask = pos >= 3
    adv = np.concatenate([np.full(n, rng.normal()) for n in sample_lens]).astype(np.float32)
    # Sampler logprobs near a plausible value so ratios are neither 1 nor masked away.
    sampler = np.where(mask, -np.log(vocab) + rng.normal(0, 0.05, mask.shape[0]), 0.0).astype(np.float32)
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        loss_mask=mask,
        advantages=np.where(mask, adv, 0.0).astype(np.float32),
        sampler_logprobs=sampler,
        token_versions=np.where(mask, 0, -1).astype(np.int32),
    )


def shared_prefix_row(rng: np.random.Generator, vocab: int) -> MicroBatch:
    """One group packed as the orchestrator's `share_prompt_prefix` does: a 6-token prompt with three
    completions; the first sample whole (12 tokens), then two branches continuing its first 5 tokens
    (positions 5.., each opening with the last prompt token)."""
    prompt = rng.integers(0, vocab, 6)
    completions = [rng.integers(0, vocab, n) for n in (6, 3, 5)]
    ids = [np.concatenate([prompt, completions[0]])]
    ids += [np.concatenate([prompt[5:], c]) for c in completions[1:]]
    pos = [np.arange(12)] + [np.arange(5, 6 + len(c)) for c in completions[1:]]
    row = packed_row(rng, [12, 4, 6], vocab)  # advantages and sampler logprobs per sample
    position_ids = np.concatenate(pos).astype(np.int32)
    mask = position_ids >= 6
    return MicroBatch(
        input_ids=np.concatenate(ids).astype(np.int32),
        position_ids=position_ids,
        loss_mask=mask,
        advantages=np.where(mask, row.advantages, 0.0).astype(np.float32),
        sampler_logprobs=np.where(mask, row.sampler_logprobs, 0.0).astype(np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
    )


def make_micro_batches(vocab: int, seed: int = 0) -> list[MicroBatch]:
    """Four rows with 1-3 packed samples of uneven lengths (odd lengths exercise the padding), and one
    row with a shared prompt (`shared_prefix_row`)."""
    rng = np.random.default_rng(seed)
    layouts = [[11, 7, 5], [17], [9, 12], [6, 6, 8]]
    return [*(packed_row(rng, lens, vocab) for lens in layouts), shared_prefix_row(rng, vocab)]


def num_loss_tokens(mbs: list[MicroBatch]) -> int:
    return int(sum(mb.num_loss_tokens for mb in mbs))
