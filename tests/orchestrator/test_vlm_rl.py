"""`rl @ configs/tiny/rl_vlm.toml` (issue 40): the tiny VLM trains on image-shapes with an image in each of
two turns, three real processes on CPU, and exits 0; every 4th task's second image is corrupt
(`broken_every`): those episodes end in an error naming the example and the image, and the run goes on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import zygote
from proc_helpers import free_port, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.mark.timeout(600)
def test_the_tiny_vlm_trains_with_images_in_two_turns(tiny_vlm_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {"id": "image-shapes", "args": {"num_examples": 64, "turns": 2, "broken_every": 4}}
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl_vlm.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_vlm_model_dir), "--max-steps", str(STEPS),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--orchestrator.env", json.dumps(env),
    ]  # fmt: skip
    env_vars = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = zygote.run(cmd, cwd=ROOT, env=env_vars, timeout=540)
    logs = {p.stem: p.read_text() for p in sorted((out / "logs").glob("*.log"))}
    tail = "\n".join(text[-3000:] for text in logs.values())
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{tail}"
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in trainer] == list(range(STEPS))
    assert trainer[0]["mismatch_kl"] < 1e-6, "engine and trainer agree on image prompts at version 0"
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    assert all(m["env/image-shapes/metric/images"] == 2.0 for m in orch), "an image in each of two turns"
    assert all(m["rollout/images_per_episode"] == 2.0 for m in orch)  # the VLM metrics (metrics.md)
    assert any(m.get("inference/vision_s", 0.0) > 0 for m in orch), "the engine's vision-tower seconds"
    assert orch[-1]["env/image-shapes/images"] >= 2 * orch[-1]["env/image-shapes/episodes/ok"] - 1
    errors = [line for line in logs["orchestrator"].splitlines() if "episode error" in line]
    assert orch[-1]["env/image-shapes/episodes/error"] >= 1 and errors, "the corrupt images' episodes"
    assert all("on example" in line for line in errors)
    assert "does not decode" in logs["orchestrator"]
    assert "image processor differs" not in logs["orchestrator"], "the engine expands images as the gateway"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_teacher_scores_image_episodes(tiny_vlm_model_dir: Path, tmp_path: Path) -> None:
    """On-policy distillation with the initial VLM as teacher: its engine scores each episode with the
    episode's images (expanded placeholders + image_data), so batch 0's reverse KL is 0 up to float noise."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl_vlm.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_vlm_model_dir), "--max-steps", "2",
        "--orchestrator.teacher.model", str(tiny_vlm_model_dir), "--orchestrator.teacher.env-weight", "1",
    ]  # fmt: skip
    proc = zygote.run(cmd, cwd=ROOT, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics/orchestrator.jsonl")
    assert abs(rows[0]["opd/reverse_kl"]) < 1e-3, rows[0]
    assert sum(r["teacher/tokens"] for r in rows) > 0
