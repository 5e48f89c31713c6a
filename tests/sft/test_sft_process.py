"""`sft` as a user runs it: real processes on the tiny model, JSONL data, checkpoints, resume, then `rl`
started from its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import zygote
from proc_helpers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _write_data(path: Path, n: int = 48) -> None:
    words = ["abc", "de", "fgh", "ij", "klm", "nop", "qr", "st"]
    lines = []
    for i in range(n):
        text = " ".join(words[(i + j) % len(words)] for j in range(1 + i % 3))
        user, assistant = (
            {"role": "user", "content": f"Reverse: {text}"},
            {"role": "assistant", "content": text[::-1]},
        )
        lines.append(json.dumps({"messages": [user, assistant]}))
    path.write_text("\n".join(lines) + "\n")


def _config(tmp: Path, model_dir: Path, data: Path) -> Path:
    path = tmp / "sft.toml"
    path.write_text(
        f'seq_len = 128\nmax_steps = 6\npublish_interval = 3\n[model]\npath = "{model_dir}"\n'
        f'[wandb]\nenabled = false\n[data]\nfiles = ["{data}"]\nbatch_size = 8\n'
        "[optim]\nlr = 1e-3\n[ckpt]\ninterval = 3\n"
    )
    return path


def _sft(config: Path, out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "prime_async.entrypoints.sft", "@", str(config), "--output-dir", str(out)]
    return zygote.run([*cmd, *extra], cwd=ROOT, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_resumes_exactly_and_rl_starts_from_its_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    _write_data(data)
    config = _config(tmp_path, tiny_model_dir, data)

    whole = _sft(config, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    losses = {m["step"]: m["loss/total"] for m in read_jsonl(tmp_path / "whole/metrics/sft.jsonl")}
    assert sorted(losses) == list(range(6)) and losses[5] < 0.85 * losses[0], losses  # it learns
    assert "step 5 | loss" in whole.stderr and "epoch 1.00" in whole.stderr
    published = sorted(p.name for p in (tmp_path / "whole/broadcasts").iterdir() if p.is_dir())
    assert published == ["step_3", "step_6"]

    first = _sft(config, tmp_path / "split", "--max-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _sft(config, tmp_path / "split", "--ckpt.resume", "true")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = {m["step"]: m["loss/total"] for m in read_jsonl(tmp_path / "split/metrics/sft.jsonl")}
    assert [resumed[s] for s in (3, 4, 5)] == pytest.approx([losses[s] for s in (3, 4, 5)], rel=1e-5)
    a = load_file(tmp_path / "whole/final/model.safetensors")
    b = load_file(tmp_path / "split/final/model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5

    rl = zygote.run(
        [sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
         "--model.path", str(tmp_path / "whole/final"), "--max-steps", "2",
         "--output-dir", str(tmp_path / "rl"), "--transport.port", "0", "--inference.server.port", "0"],
        cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(tmp_path / "rl/metrics/trainer.jsonl")] == [0, 1]


def test_bad_data_is_one_line_naming_the_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    proc = _sft(_config(tmp_path, tiny_model_dir, data), tmp_path / "out", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"data.files: {data}:2: not JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("variant", ["lora", "megatron"])
def test_lora_and_megatron_sft_leave_a_full_model(variant: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer's options apply to sft: a LoRA run's final directory is the merged model, a megatron run
    checkpoints in its own format; either final directory loads as a plain HF model."""
    if variant == "megatron":
        pytest.importorskip("megatron.core", reason="needs the `megatron` extra")
    data = tmp_path / "data.jsonl"
    _write_data(data, n=16)
    extra = ["--lora.rank", "4"] if variant == "lora" else ["--backend", "megatron"]
    proc = _sft(_config(tmp_path, tiny_model_dir, data), tmp_path / "out", "--max-steps", "3", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out/final")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in model.state_dict().items() if not (p == base.state_dict()[n]).all()]
    assert changed, "the final model equals the base model"
    assert (tmp_path / "out/checkpoints/trainer/step_3/COMPLETE").exists()
