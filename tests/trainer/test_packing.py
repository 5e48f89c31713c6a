"""Packed micro-batches: position_ids restarting per sample give exactly the per-sample logprobs."""

from __future__ import annotations

import pytest
import torch

from prime_async.trainer.train import packed_logprobs


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
