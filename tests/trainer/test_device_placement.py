"""Every tensor the trainer feeds a model is on the model's device (CPU tests, model on the meta device).

The first GPU run failed where tensors were built on the CPU for a CUDA model. Here the model's parameters
are on the meta device and a spy on its forward (`tests/device_spy.py`) checks each input, then stops the
forward: the FSDP backend's micro-batch pass (routing replay included), the doctor's trainer-model scoring,
and the megatron backend (`tests/megatron/test_megatron_devices.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "megatron"))

from megatron_batches import make_micro_batches

from device_spy import InputsOnDevice, spy_inputs
from prime_async.config.trainer import MaskLossConfig
from prime_async.rollouts.types import Episode
from prime_async.trainer.fsdp import micro_batch_pass
from prime_async.trainer.loss import build_loss_fn

META = torch.device("meta")


@pytest.fixture(autouse=True)
def _meta_data(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Meta tensors have no values: `torch.nonzero` (`logit_rows`) assumes a shape, and a meta row is taken
    to have branches, so its attention mask is built (and checked) too. The spy stops before it matters."""
    import torch.fx.experimental._config as fx_config

    from prime_async.trainer import packed_rows

    real = packed_rows.has_branches
    monkeypatch.setattr(packed_rows, "has_branches", lambda pos: pos.device == META or real(pos))
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def _meta_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(META)


def _pass(model, mb, replay=None) -> None:
    micro_batch_pass(
        model, mb, loss_fn=build_loss_fn(MaskLossConfig()), temperature=1.0, num_loss_tokens=10,
        grad_scale=1.0, replay=replay,
    )  # fmt: skip


def test_fsdp_micro_batch_inputs_are_on_the_model_device(tiny_model_dir: Path) -> None:
    model = _meta_model(tiny_model_dir)
    calls = spy_inputs(model, stop=True)
    for mb in make_micro_batches(model.config.vocab_size)[-2:]:  # a plain row, a row with branches
        with pytest.raises(InputsOnDevice):
            _pass(model, mb)
    assert {"input_ids", "position_ids", "logits_to_keep", "attention_mask"} <= set(calls[-1])


def test_router_replay_routes_are_on_the_model_device(tiny_moe_model_dir: Path) -> None:
    from prime_async.trainer.router_replay import RouterReplay

    model = _meta_model(tiny_moe_model_dir)
    replay = RouterReplay(model)
    spy_inputs(model, stop=True)
    checked = model.forward
    seen: list[torch.device] = []
    model.forward = lambda *a, **k: (seen.append(replay._routes.device), checked(*a, **k))[1]
    mb = make_micro_batches(model.config.vocab_size)[1]
    mb.routed_experts = np.zeros((mb.num_tokens, replay.width), dtype=np.int16)
    with pytest.raises(InputsOnDevice):
        _pass(model, mb, replay)
    assert seen == [META]


def test_doctor_scoring_inputs_are_on_the_model_device(tiny_model_dir: Path) -> None:
    from prime_async.doctor.logprobs import score_kl

    model = _meta_model(tiny_model_dir)
    calls = spy_inputs(model, stop=True)
    episode = Episode(
        example_id=0, token_ids=[5, 6, 7, 8], loss_mask=[False, False, True, True],
        sampler_logprobs=[0.0, 0.0, -1.0, -1.0], token_versions=[-1, -1, 0, 0],
    )  # fmt: skip
    with pytest.raises(InputsOnDevice):
        score_kl(model, [episode], temperature=1.0)
    assert set(calls[0].values()) == {META}
