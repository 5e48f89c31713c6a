"""MoE routing replay (R3) end to end on the tiny MoE model: the embedded engine samples with
`return_routed_experts`, the routes go through the gateway's episode layout and the batch packing, and the
fsdp trainer's forward replays them.

At version 0 (same weights), with replay the trainer's logprobs equal the engine's to fp32 precision;
without, the trainer routes by itself and the mismatch KL is larger. The engine runs in bfloat16 here,
as GPU engines do, while the trainer runs in float32: routing then differs on near-tied router scores,
which is what R3 removes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from prime_async.inference.engine import Engine, RequestOutput
from prime_async.inference.engine_settings import EngineSettings, SlotSettings
from prime_async.inference.sampler import SamplingParams
from prime_async.rollouts.episode import branch_routes
from prime_async.rollouts.gateway import GatewayCall
from prime_async.trainer.packed_rows import packed_logprobs
from prime_async.trainer.router_replay import RouterReplay
from prime_async.transport.types import MicroBatch


async def _sample(model_dir: Path, dtype: str, prompts: list[list[int]]) -> list[RequestOutput]:
    engine = Engine(
        EngineSettings(
            model_path=str(model_dir),
            dtype=dtype,
            device="cpu",
            slots=SlotSettings(max_running_requests=8, max_len=256),
        )
    )
    engine.start()
    try:
        params = [
            SamplingParams(max_new_tokens=24, ignore_eos=True, sampling_seed=i) for i in range(len(prompts))
        ]
        return await asyncio.gather(
            *(
                engine.generate(p, sp, return_routed_experts=True)
                for p, sp in zip(prompts, params, strict=True)
            )
        )
    finally:
        engine.stop()


def _row(prompt: list[int], out: RequestOutput) -> MicroBatch:
    tokens = prompt + out.output_ids
    call = GatewayCall(prompt, out.output_ids, out.logprobs, [0] * len(out.output_ids), "length", 0,
                       routed_experts=out.routed_experts.to(torch.int32).numpy().reshape(-1))  # fmt: skip
    mask = np.array([False] * len(prompt) + [True] * len(out.output_ids))
    return MicroBatch(
        input_ids=np.array(tokens, dtype=np.int32),
        position_ids=np.arange(len(tokens), dtype=np.int32),
        loss_mask=mask,
        advantages=np.zeros(len(tokens), dtype=np.float32),
        sampler_logprobs=np.where(mask, [0.0] * len(prompt) + out.logprobs, 0.0).astype(np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
        routed_experts=branch_routes(tokens, [call]),
    )


def _trainer_logprobs(model, replay: RouterReplay, mb: MicroBatch, *, replayed: bool) -> torch.Tensor:
    ids, pos = (
        torch.from_numpy(mb.input_ids.astype(np.int64)),
        torch.from_numpy(mb.position_ids.astype(np.int64)),
    )
    mask = torch.from_numpy(mb.loss_mask)
    with torch.no_grad(), replay.replaying(mb.routed_experts if replayed else None, ids.device):
        logp, _ = packed_logprobs(model, ids, pos, 1.0, loss_mask=mask)
    return logp[mask]


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_replayed_routing_matches_the_engine(engine_dtype: str, tiny_moe_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,)).tolist() for n in (9, 17, 30, 5)]
    outs = asyncio.run(_sample(tiny_moe_model_dir, engine_dtype, prompts))
    rows = [_row(p, o) for p, o in zip(prompts, outs, strict=True)]
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).eval()
    replay = RouterReplay(model)
    kl = {}
    for replayed in (True, False):
        diffs = []
        for mb in rows:
            mask = torch.from_numpy(mb.loss_mask)
            sampler = torch.from_numpy(mb.sampler_logprobs)[mask]
            diffs.append(_trainer_logprobs(model, replay, mb, replayed=replayed) - sampler)
        d = torch.cat(diffs).double()
        kl[replayed] = float((d.exp() - 1 - d).mean())  # k3 estimator of KL(sampler || trainer)
        kl[f"max_{replayed}"] = float(d.abs().max())
    agreement = replay.metrics()
    print(engine_dtype, kl, agreement)
    tokens = sum(int(mb.loss_mask.sum()) for mb in rows)
    # every token but each row's last has a route (the engine never ran the last one), prompt tokens
    # included; counted per MoE layer (3), in the replayed pass only
    assert agreement["moe/replayed_routes"] == 3 * sum(mb.num_tokens - 1 for mb in rows)
    assert tokens == 4 * 24
    if engine_dtype == "float32":  # same weights, same dtype: replay reproduces the engine's forward
        assert kl["max_True"] < 1e-5 and kl[True] < 1e-10
        assert agreement["moe/routing_agreement"] > 0.99
    else:  # bf16 sampler vs fp32 trainer: routing flips on near ties; replay removes that part
        assert agreement["moe/routing_agreement"] < 1.0
        assert kl[False] > 3 * kl[True], kl
        assert kl["max_False"] > kl["max_True"], kl


def test_replay_holds_through_activation_checkpointing(tiny_moe_model_dir: Path) -> None:
    """Recorded routes that differ from the model's own (every token sent to experts 2 and 3): the
    gradients with activation checkpointing (the backward runs the forward again) equal those without."""
    from transformers import AutoModelForCausalLM

    from prime_async.config.trainer import MaskLossConfig
    from prime_async.trainer.fsdp import micro_batch_pass
    from prime_async.trainer.loss import build_loss_fn
    from prime_async.trainer.parallelize import parallelize

    ids = torch.randint(3, 1000, (20,), generator=torch.Generator().manual_seed(2)).numpy().astype(np.int32)
    mask = np.arange(20) >= 8
    mb = MicroBatch(
        input_ids=ids,
        position_ids=np.arange(20, dtype=np.int32),
        loss_mask=mask,
        advantages=np.where(mask, 1.0, 0.0).astype(np.float32),
        sampler_logprobs=np.where(mask, -7.0, 0.0).astype(np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
        routed_experts=np.tile(np.array([2, 3], dtype=np.int16), (20, 3)),
    )
    grads = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32).train()
        replay = RouterReplay(model)
        model = parallelize(model, activation_checkpointing=checkpointing, compile=False)
        micro_batch_pass(
            model, mb, loss_fn=build_loss_fn(MaskLossConfig()), temperature=1.0, num_loss_tokens=12,
            grad_scale=1.0, replay=replay,
        )  # fmt: skip
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert replay.metrics()["moe/routing_agreement"] < 1.0  # the routes were not the model's own
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
