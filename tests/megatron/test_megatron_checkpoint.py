"""Megatron-backend checkpoints (`trainer/megatron/checkpoint.py`) through the real trainer loop.

Run A trains steps 0-2 as one process (TP=1) with a checkpoint at step 2. Run B starts from A's checkpoint
under torchrun at TP=2 (`ckpt.resume = true`) and trains step 2: its loss and published weights must equal A's
(the checkpoint is layout-free and resuming is exact). `export-megatron` turns A's checkpoint into an HF
directory equal to the version A published at that step. The fsdp backend refuses the checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="needs the `megatron` extra")

from loop_runner import run_megatron_loop, trainer_metrics

from prime_async.trainer.ckpt import checkpoint_root, load_checkpoint


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.needs_devices(2)  # the resumed run has two ranks
def test_resume_at_another_layout_is_exact_and_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    ckpt = {"interval": 2, "keep": None}
    run_megatron_loop(
        model_dir=tiny_model_dir, out=a, config_dir=tmp_path / "cfg_a", nproc=1, steps=range(3), ckpt=ckpt
    )
    saved = checkpoint_root(a) / "step_2"
    assert (saved / "COMPLETE").is_file() and (saved / "megatron" / "metadata.json").is_file()
    shutil.copytree(saved, checkpoint_root(b) / "step_2")
    log = run_megatron_loop(
        model_dir=tiny_model_dir,
        out=b,
        config_dir=tmp_path / "cfg_b",
        nproc=2,
        steps=range(2, 3),
        ckpt={**ckpt, "resume": True},
    )
    assert "resumed from" in log and "loaded at tp=2" in log, log[-3000:]
    (row_a,) = [m for m in trainer_metrics(a) if m["step"] == 2]
    (row_b,) = trainer_metrics(b)
    assert row_b["step"] == 2
    assert row_b["loss/total"] == pytest.approx(row_a["loss/total"], rel=1e-5, abs=1e-7)
    after_a, after_b = _weights(a / "broadcasts" / "step_3"), _weights(b / "broadcasts" / "step_3")
    assert after_a.keys() == after_b.keys()
    for name, tensor in after_a.items():
        # TP=2 reduces in another order than TP=1: float32 rounding, far below one update (lr 1e-5)
        torch.testing.assert_close(after_b[name], tensor, rtol=0, atol=1e-7, msg=name)

    exported = tmp_path / "hf_step_2"
    cmd = [sys.executable, "-m", "prime_async.entrypoints.export_megatron"]
    cmd += ["--checkpoint", str(saved), "--output", str(exported)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    published = _weights(a / "broadcasts" / "step_2")
    converted = _weights(exported)
    assert converted.keys() == published.keys()
    for name, tensor in published.items():
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)
    assert (exported / "tokenizer.json").is_file() and (exported / "config.json").is_file()

    from prime_async.config.export import ExportMegatronConfig
    from prime_async.trainer.megatron.export import run as export_run

    with pytest.raises(ValueError, match="exists and is not empty"):  # refused before anything is loaded
        export_run(ExportMegatronConfig(checkpoint=saved, output=exported))
    with pytest.raises(ValueError, match=r"trainer\.backend = 'megatron' but this trainer is 'fsdp'"):
        load_checkpoint(saved, model=None, optimizer=None, scheduler=None)
