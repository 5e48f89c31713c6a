"""Feeds one train step of the megatron backend to a model moved to the meta device (CPU ranks, one
process): the spy on its forward (`tests/device_spy.py`) checks that every input is on the model's device
(meta) and stops the step there. Prints `inputs on meta: <names>` and exits 0; exits non-zero with the
spy's message when an input was built elsewhere (the device the backend was given, the CPU).

Usage: `python device_worker.py <model dir>` with CUDA hidden.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import torch
from megatron_batches import make_micro_batches, num_loss_tokens

from device_spy import InputsOnDevice, spy_inputs
from prime_async.config.shared import ModelConfig
from prime_async.config.trainer import TrainerConfig
from prime_async.trainer.megatron.backend import MegatronBackend
from prime_async.transport.zmq_batches import RankBatch


def main(model_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = TrainerConfig(backend="megatron", model=ModelConfig(path=model_dir, dtype="float32"))
    backend = MegatronBackend.from_config(cfg, torch.device("cpu"))
    backend.model.to("meta")  # parameters elsewhere than the `device` the backend was built with
    spy_inputs(backend.model, stop=True)
    mbs = make_micro_batches(backend.vocab_size)
    batch = RankBatch(
        step=0, rank=0, micro_batches=mbs, layout=[[mb.num_tokens for mb in mbs]],
        num_loss_tokens=num_loss_tokens(mbs), temperature=1.0, min_dispatch_version=0,
    )  # fmt: skip
    try:
        backend.train_rank_batch(batch)
    except InputsOnDevice as checked:
        print("inputs on meta:", ", ".join(sorted(checked.args[0])), flush=True)
        return
    raise SystemExit("the train step never called the model")


if __name__ == "__main__":
    main(sys.argv[1])
