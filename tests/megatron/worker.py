"""Megatron worker for the tests, run under `torchrun --nproc-per-node {1,2}`: on CPU ranks (gloo,
`trainer/megatron/cpu_ranks.py`; the test hides CUDA from it), or with `--device cuda` on GPUs (NCCL;
`test_megatron_gpu.py`). Every forward of the backend's model is spied on (`tests/device_spy.py`): an input
on another device than the model's parameters fails the run naming it.

Writes (rank 0) into --out: `logits.pt` (packed logits of every test row, per model dir), `initial.pt` and
`after.pt` (the exported HF state dicts before and after one train step, of `--steps-per-batch` optimizer
steps) and `metrics.json`.
All comparisons against HF / the FSDP backend are made by the pytest side, outside this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import torch
import torch.distributed as dist
from megatron_batches import make_micro_batches, num_loss_tokens

from device_spy import spy_inputs
from prime_async.config.megatron import MegatronConfig, read_hf_config
from prime_async.config.trainer import MaskLossConfig, OptimConfig
from prime_async.trainer.loss import build_loss_fn
from prime_async.trainer.megatron.backend import MegatronBackend
from prime_async.trainer.megatron.batch import pack_logits, unpack
from prime_async.trainer.megatron.cpu_ranks import enable_cpu_ranks
from prime_async.trainer.megatron.model import build_gpt_model, load_hf_weights
from prime_async.transport.zmq_batches import RankBatch
from prime_async.utils.devices import model_device

TEMPERATURE = 0.9
LR = 1e-3


@torch.no_grad()
def packed_logits(model, mbs, vocab: int, seq_multiple: int) -> list[torch.Tensor]:
    out = []
    for mb in mbs:
        padded = unpack(mb, seq_multiple=seq_multiple, device=model_device(model))
        logits = model(padded.input_ids, padded.position_ids, attention_mask=padded.attention_mask)
        out.append(pack_logits(logits, padded, vocab).float().cpu())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--extra-model-dir", action="append", default=[])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--distributed-optimizer", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps-per-batch", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":  # refuses when CUDA is visible: the test hides it for CPU runs
        torch.set_num_threads(1)
        enable_cpu_ranks()
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    cfg = MegatronConfig(
        tensor_parallel_size=args.tp,
        expert_parallel_size=args.ep,
        use_distributed_optimizer=bool(args.distributed_optimizer),
    )
    backend = MegatronBackend(
        megatron=cfg,
        model_path=args.model_dir,
        optim=OptimConfig(lr=LR, num_steps_per_batch=args.steps_per_batch),
        loss_fn=build_loss_fn(MaskLossConfig()),
        dtype=torch.float32,
        device=device,
    )
    spied = spy_inputs(backend.model)
    seq_multiple = backend._seq_multiple()
    vocab = backend.vocab_size
    mbs = make_micro_batches(vocab)
    logits = {"main": packed_logits(backend.model, mbs, vocab, seq_multiple)}
    for i, extra in enumerate(args.extra_model_dir):
        hf = read_hf_config(extra)
        model = build_gpt_model(hf, cfg, dtype=torch.float32, device=device)
        load_hf_weights(model, extra, hf, cfg)
        logits[f"extra{i}"] = packed_logits(
            model, make_micro_batches(hf["vocab_size"]), hf["vocab_size"], seq_multiple
        )
    initial = backend.hf_state_dict()
    # As the orchestrator would: one share per process; the model-parallel peers regroup them.
    share = RankBatch(
        step=0,
        rank=rank,
        micro_batches=mbs[rank::world],
        layout=[[mb.num_tokens for mb in mbs[r::world]] for r in range(world)],
        num_loss_tokens=num_loss_tokens(mbs),
        temperature=TEMPERATURE,
        min_dispatch_version=0,
    )
    calls = len(spied)
    metrics = backend.train_rank_batch(share)
    assert len(spied) > calls, "the train step did not run the spied model"
    after = backend.hf_state_dict()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(logits, out / "logits.pt")
        torch.save(initial, out / "initial.pt")
        torch.save(after, out / "after.pt")
        (out / "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
