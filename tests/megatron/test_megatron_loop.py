"""The megatron trainer loop end to end: batches over real ZeroMQ in, HF weight versions out.

A `BatchSender` (the orchestrator's side) streams two batches to the trainer loop (megatron backend)
running under torchrun with TP=2 (two processes, each receiving its own share), or as one plain process;
the loop must publish `broadcasts/step_1` and `step_2` (STABLE last) that plain transformers loads, and
log the trainer metrics to the JSONL. Each batch is trained as two mini-batches (`optim.num_steps_per_batch
= 2`): two optimizer steps, one published version.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the `megatron` extra")

from megatron_batches import make_micro_batches, num_loss_tokens

from prime_async.config.shared import TransportConfig
from prime_async.transport.types import TrainBatch
from prime_async.transport.zmq_batches import BatchSender

WORKER = Path(__file__).with_name("loop_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1], ids=["torchrun_tp2", "single_process"])
def test_megatron_loop_trains_and_publishes(nproc: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    """nproc = 1 runs without torchrun: the backend opens its own world-size-1 process group."""
    transport = TransportConfig(port=_free_port(), timeout_s=600)
    cfg = {
        "backend": "megatron",
        "megatron": {"tensor_parallel_size": nproc},
        "model": {"path": str(tiny_model_dir), "dtype": "float32"},
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
        "num_processes": nproc,
        "transport": transport.model_dump(),
        "wandb": {"enabled": False},
        "ckpt": {"interval": None},
        "optim": {"num_steps_per_batch": 2},
    }
    (tmp_path / "trainer.json").write_text(json.dumps(cfg))
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    )
    cmd = [sys.executable, *launcher, str(WORKER), str(tmp_path / "trainer.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    mbs = make_micro_batches(1024)
    shares = [mbs[:2], mbs[2:]] if nproc == 2 else [mbs]  # one share per trainer process
    with BatchSender(cfg=transport, num_ranks=nproc) as sender:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for step in range(2):
                sender.send(
                    TrainBatch(
                        step=step,
                        micro_batches=shares,
                        num_loss_tokens=num_loss_tokens(mbs),
                        temperature=1.0,
                        min_dispatch_version=step,
                    )
                )
            out, _ = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-6000:]

    from transformers import AutoModelForCausalLM

    broadcasts = tmp_path / "run" / "broadcasts"
    assert (broadcasts / "step_1" / "STABLE").is_file() and (broadcasts / "step_2" / "STABLE").is_file()
    v1 = AutoModelForCausalLM.from_pretrained(broadcasts / "step_1", dtype=torch.float32)
    v2 = AutoModelForCausalLM.from_pretrained(broadcasts / "step_2", dtype=torch.float32)
    v0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    w = "model.layers.0.mlp.up_proj.weight"
    s0, s1, s2 = (m.state_dict()[w] for m in (v0, v1, v2))
    assert not torch.equal(s0, s1) and not torch.equal(s1, s2)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    assert all(x["optim/grad_norm"] > 0 and "loss/total" in x and "mismatch_kl" in x for x in lines)
    # token versions 0: batch n's mini-batches are 2n and 2n + 1 optimizer steps off-policy
    assert [x["optim/num_steps"] for x in lines] == [2, 2]
    assert [x["offpolicy/effective_steps/max"] for x in lines] == [1, 3]
    assert (
        0
        < lines[0]["offpolicy/effective_steps/mean"]
        < 1
        < 2
        < lines[1]["offpolicy/effective_steps/mean"]
        < 3
    )
