"""parallelize(): activation checkpointing keeps parameter names and gradients (FSDP2 is covered by the
torchrun test in test_trainer_process.py)."""

from __future__ import annotations

import pytest
import torch

from prime_async.trainer.packed_rows import packed_logprobs
from prime_async.trainer.parallelize import parallelize


def _grads(model) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(10), torch.arange(14)])
    logp, _ = packed_logprobs(model, ids, pos, 1.0)
    logp.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_same_names_and_grads(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    ac = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    ac = parallelize(ac, activation_checkpointing=True, compile=False, dp_mesh=None)
    assert list(ac.state_dict()) == list(plain.state_dict())
    want, got = _grads(plain), _grads(ac)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_rejects_models_without_layers() -> None:
    with pytest.raises(ValueError, match=r"model\.layers"):
        parallelize(torch.nn.Linear(2, 2), activation_checkpointing=False, compile=False)
