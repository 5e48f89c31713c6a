"""The two-level draw of plain temperature sampling (`inference/sampler.py`): zero-weight tokens are never
drawn, the empirical distribution is the softmax and the reported logprob is log_softmax's."""

from __future__ import annotations

import torch

from prime_async.inference.sampler import DRAW_BLOCK, SamplingParams, _draw_blocked, sample


def test_blocked_draw_never_picks_zero_weight_tokens() -> None:
    v = 4 * DRAW_BLOCK
    weights = torch.zeros(6, v)
    weights[:, [0, DRAW_BLOCK - 1, 3 * DRAW_BLOCK]] = torch.tensor([1.0, 2.0, 1.0])
    u = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 1.0 - 2**-24])
    tokens, total = _draw_blocked(weights, u)
    assert tokens.tolist() == [0, 0, DRAW_BLOCK - 1, DRAW_BLOCK - 1, 3 * DRAW_BLOCK, 3 * DRAW_BLOCK]
    assert total.tolist() == [4.0] * 6


def test_plain_sampling_over_a_blocked_vocabulary_is_softmax_distributed() -> None:
    """Plain temperature sampling takes the two-level draw when the vocabulary is a multiple of the block:
    the empirical distribution is the softmax and the logprob is log_softmax's."""
    g = torch.Generator().manual_seed(0)
    v = 2 * DRAW_BLOCK
    logits = torch.randn(1, v, generator=g) * 2
    logits[0, 10 : 10 + DRAW_BLOCK] = -1e4  # a block (and a half) of zero probability
    n = 50_000
    params = [SamplingParams(temperature=0.7)] * n
    tokens, logprobs = sample(logits.expand(n, v), params, [None] * n, g)
    freq = torch.bincount(torch.tensor(tokens), minlength=v).double() / n
    probs = torch.softmax(logits[0].double() / 0.7, -1)
    assert float((freq - probs).abs().max()) < 0.01
    assert float(freq[10 : 10 + DRAW_BLOCK].sum()) == 0.0
    ref = torch.log_softmax(logits[0] / 0.7, -1)[torch.tensor(tokens)]
    assert float((torch.tensor(logprobs) - ref).abs().max()) < 1e-5
