"""The megatron backend on real GPUs (NCCL, no shim): logits vs HF, export, one step vs the FSDP step.

Skipped without CUDA (`gpu` marker). Run by `scripts/gpu_smoke_megatron.sh` on a GPU machine. Uses TP=2 when
two GPUs are visible, else TP=1. Tolerances are the CPU ones loosened for TF32/cuBLAS reduction order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the `megatron` extra")

from megatron_batches import make_micro_batches
from test_megatron_backend import _hf_packed_logits, _run_worker


@pytest.mark.gpu
def test_megatron_backend_on_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    tp = 2 if torch.cuda.device_count() >= 2 else 1
    out = _run_worker(tmp_path / "gpu", tiny_model_dir, [], nproc=tp, tp=tp, device="cuda")
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    ref = _hf_packed_logits(tiny_model_dir, make_micro_batches(vocab))
    logits = torch.load(out / "logits.pt")["main"]
    for got, want in zip(logits, ref, strict=True):
        assert (got - want).abs().max().item() < 1e-3
    metrics = json.loads((out / "metrics.json").read_text())
    assert torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert metrics["optim/grad_norm"] > 0
