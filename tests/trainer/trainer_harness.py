"""Run the trainer as a real subprocess (plain or under torchrun) and feed it batches over ZeroMQ."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import tomli_w
import torch

from prime_async.config.shared import TransportConfig
from prime_async.testing.synthetic import make_batch
from prime_async.trainer.packed_rows import packed_logprobs
from prime_async.transport.types import TrainBatch

ROOT = Path(__file__).resolve().parents[2]


def write_config(
    path: Path, *, model_dir: Path, output_dir: Path, transport: TransportConfig, **extra
) -> Path:
    cfg = {
        "model": {"path": str(model_dir), "dtype": "float32"},  # runs compared at fp32 tolerances
        "output_dir": str(output_dir),
        "wandb": {"enabled": False},
        "seq_len": 256,
        "transport": transport.model_dump(exclude_none=True),  # TOML has no null
        "optim": {"lr": 1e-3, "max_grad_norm": 1.0},
        "ckpt": {"interval": 1, "keep": 2},
        **extra,
    }
    path.write_text(tomli_w.dumps(cfg))
    return path


def start_trainer(config: Path, *extra_args: str, nproc: int | None = None, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if nproc is None:
        cmd = [sys.executable, "-m", "prime_async.entrypoints.trainer"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "prime_async.entrypoints.trainer",
        ]
    out = log.open("ab")
    return subprocess.Popen([*cmd, "@", str(config), *extra_args], cwd=ROOT, env=env, stdout=out, stderr=out)


def wait(proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"trainer did not finish in {timeout}s:\n{log.read_text()[-4000:]}") from None
    assert rc == 0, f"trainer exited {rc}:\n{log.read_text()[-4000:]}"


@functools.cache
def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def batch(step: int, num_ranks: int = 1, *, model_dir: Path) -> TrainBatch:
    """3 micro-batches of packed samples; split round-robin over `num_ranks` (same tokens for any split).

    Sampler logprobs are the start model's own logprobs plus small noise (a realistic sampler mismatch),
    so the ratio stays inside the trust region and the loss has a gradient."""
    whole = make_batch(step, [[[20, 30], [40, 12, 8], [25]]], seed=7, vocab=1000, temperature=0.9)
    mbs = whole.micro_batches[0]
    gen = torch.Generator().manual_seed(step)
    for mb in mbs:
        with torch.no_grad():
            logp, _ = packed_logprobs(
                _model(model_dir),
                torch.from_numpy(mb.input_ids).long(),
                torch.from_numpy(mb.position_ids).long(),
                0.9,
            )
        noisy = logp + 0.05 * torch.randn(logp.shape, generator=gen)
        mb.sampler_logprobs = np.where(mb.loss_mask, noisy.numpy(), 0).astype(np.float32)
    whole.micro_batches = [mbs[r::num_ranks] for r in range(num_ranks)]
    return whole


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics" / "trainer.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
