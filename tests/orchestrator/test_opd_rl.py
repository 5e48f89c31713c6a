"""On-policy distillation in a real `rl` run: rl serves the teacher on an engine of its own, every trained
token carries the teacher's logprob, and the cost shows in the metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import zygote
from proc_helpers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _rl(out: Path, model_dir: Path, teacher: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir),
        "--orchestrator.teacher.model", str(teacher), "--transport.port", "0", "--inference.server.port", "0",
        *extra,
    ]  # fmt: skip
    return zygote.run(cmd, cwd=ROOT, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_rl_with_the_initial_model_as_teacher(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Teacher = the student's initial weights: batch 0 (sampled at version 0) has reverse KL 0 up to float
    noise, later batches drift away from it as the student trains."""
    out = tmp_path / "run"
    proc = _rl(
        out, tiny_model_dir, tiny_model_dir, "--max-steps", "4", "--orchestrator.teacher.env-weight", "1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "configs/teacher_inference.toml").exists() and (out / "logs/teacher_inference.log").exists()
    rows = read_jsonl(out / "metrics/orchestrator.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert abs(rows[0]["opd/reverse_kl"]) < 1e-3, rows[0]["opd/reverse_kl"]
    for row in rows:
        assert row["teacher/errors"] == 0 and row["ledger/dispatched"] >= 0
    assert sum(r["teacher/requests"] for r in rows) >= 4 and sum(r["teacher/tokens"] for r in rows) > 0
    assert "teacher: http://127.0.0.1:" in (out / "logs/orchestrator.log").read_text()


def test_a_missing_teacher_model_is_refused_in_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = _rl(tmp_path / "run", tiny_model_dir, tmp_path / "nowhere", "--max-steps", "2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"orchestrator.teacher.model: {tmp_path / 'nowhere'} has no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run/logs").exists()


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, teacher)
    (teacher / "tokenizer.json").write_text(
        (teacher / "tokenizer.json").read_text().replace("<|im_end|>", "<|end|>")
    )
    proc = _rl(tmp_path / "run", tiny_model_dir, teacher, "--max-steps", "2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tokenizer differs from model.path" in proc.stderr and "Traceback" not in proc.stderr
