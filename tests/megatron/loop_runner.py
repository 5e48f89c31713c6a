"""Run the megatron trainer loop (`loop_worker.py`) as real processes fed over real ZeroMQ: the
orchestrator's side is a `BatchSender` in the test process. Shared by the loop and checkpoint tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from megatron_batches import make_micro_batches, num_loss_tokens

from prime_async.config.shared import TransportConfig
from prime_async.transport.types import TrainBatch
from prime_async.transport.zmq_batches import BatchSender

WORKER = Path(__file__).with_name("loop_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_megatron_loop(
    *, model_dir: Path, out: Path, config_dir: Path, nproc: int, steps: range, **overrides
) -> str:
    """Train the batches of `steps` (the same deterministic micro-batches each step, split into one share
    per process) at TP = `nproc`; `overrides` are trainer config keys. Returns the log; asserts exit 0."""
    transport = TransportConfig(port=free_port(), timeout_s=600)
    cfg = {
        "backend": "megatron",
        "megatron": {"tensor_parallel_size": nproc},
        "model": {"path": str(model_dir), "dtype": "float32"},
        "output_dir": str(out),
        "max_steps": steps.stop,
        "num_processes": nproc,
        "transport": transport.model_dump(),
        "wandb": {"enabled": False},
        "ckpt": {"interval": None},
        **overrides,
    }
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "trainer.json").write_text(json.dumps(cfg))
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    )
    cmd = [sys.executable, *launcher, str(WORKER), str(config_dir / "trainer.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    mbs = make_micro_batches(1024)
    shares = [mbs[:2], mbs[2:]] if nproc == 2 else [mbs]  # one share per trainer process
    with BatchSender(cfg=transport, num_ranks=nproc) as sender:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for step in steps:
                batch = TrainBatch(
                    step=step,
                    micro_batches=shares,
                    num_loss_tokens=num_loss_tokens(mbs),
                    temperature=1.0,
                    min_dispatch_version=step,
                )
                sender.send(batch)
            log, _ = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, log[-6000:]
    return log


def trainer_metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
