"""scripts/bench_trainer.py's throughput table (`--device`): the same code path as on CUDA, on CPU with the
tiny shape, for both backends; its FLOP count checked against torch's FLOP counter on the real step."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_trainer.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_trainer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_trainer"] = module
    spec.loader.exec_module(module)
    return module


def test_matmul_flops_equal_torch_flop_counter(bench, tmp_path: Path) -> None:
    """The weight matmuls of a real fsdp micro-batch pass (forward + backward) as torch counts them (mm and
    addmm: attention kernels are counted apart, by `attention_flops`)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from prime_async.config.trainer import MaskLossConfig
    from prime_async.trainer.fsdp import micro_batch_pass
    from prime_async.trainer.loss import build_loss_fn

    torch.set_num_threads(1)
    model_dir = bench.build_random_model(tmp_path / "m", "tiny", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = bench.synthetic_batch(512, rows=2, seq_len=96, samples_per_row=3)
    with FlopCounterMode(display=False) as counter:
        for mb in batch.micro_batches:
            micro_batch_pass(model, mb, loss_fn=build_loss_fn(MaskLossConfig()), temperature=1.0,
                             num_loss_tokens=batch.num_loss_tokens, grad_scale=1.0)  # fmt: skip
    ops = counter.get_flop_counts()["Global"]
    counted = sum(n for op, n in ops.items() if str(op).split(".")[1] in ("mm", "addmm"))
    assert counted == bench.matmul_flops(bench.SHAPES["tiny"], batch)
    assert bench.attention_flops(bench.SHAPES["tiny"], batch) > 0


def test_throughput_table_runs_both_backends_on_cpu() -> None:
    pytest.importorskip("megatron.core", reason="needs the `megatron` extra")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--rows", "2",
           "--seq-len", "64", "--samples-per-row", "2", "--steps", "2"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["fsdp"], ["megatron"])
    }
    assert sorted(rows) == ["fsdp", "megatron"], proc.stdout
    for name, (_, seconds, tokens_per_s, _tflops, mfu) in rows.items():
        assert float(seconds) > 0 and float(tokens_per_s) > 0, name
        assert 0 < float(mfu.rstrip("%")) < 100, name
    assert "bf16 matmul peak" in proc.stdout
