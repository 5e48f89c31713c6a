"""The `eval` command: which versions it evaluates, and a real run (the embedded engine it starts, the
tiny model, a run directory with one published version) writing metrics, samples and a wandb table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prime_async.config.eval import EvalConfig
from prime_async.launcher.eval_command import versions_to_evaluate
from prime_async.weights.broadcasts import STABLE, broadcasts_root, install_version, version_dir

BIN = Path(sys.executable).parent


def publish(run_dir: Path, model_dir: Path, version: int, *, stable: bool = True) -> Path:
    """A broadcast of `model_dir`'s weights as `version` (the trainer's layout)."""
    root = broadcasts_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    staged = root / f".staged_{version}"
    shutil.copytree(model_dir, staged)
    if not stable:
        return staged.rename(version_dir(root, version))
    (staged / STABLE).write_text("")
    return install_version(root, version, staged)


def test_versions_default_newest_stable_and_refuse_a_missing_one(tmp_path: Path, tiny_model_dir: Path):
    assert versions_to_evaluate(EvalConfig()) == [(0, None)]
    for version in (1, 2):
        publish(tmp_path, tiny_model_dir, version)
    publish(tmp_path, tiny_model_dir, 3, stable=False)  # still being written
    newest = EvalConfig(weights={"run_dir": tmp_path})
    assert versions_to_evaluate(newest) == [(2, version_dir(broadcasts_root(tmp_path), 2))]
    both = EvalConfig(weights={"run_dir": tmp_path, "steps": [2, 1, 0], "include_base": True})
    assert [v for v, _ in versions_to_evaluate(both)] == [0, 1, 2]
    with pytest.raises(ValueError, match="step_3 is missing or has no STABLE marker"):
        versions_to_evaluate(EvalConfig(weights={"run_dir": tmp_path, "steps": [3]}))
    with pytest.raises(ValueError, match="has no STABLE broadcast"):
        versions_to_evaluate(EvalConfig(weights={"run_dir": tmp_path / "empty"}))


@pytest.mark.timeout(400)
def test_eval_command_evaluates_base_and_published_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "eval"
    publish(run_dir, tiny_model_dir, 1)
    config = tmp_path / "eval.toml"
    config.write_text(
        f'seq_len = 256\noutput_dir = "{out}"\n[model]\npath = "{tiny_model_dir}"\n'
        '[wandb]\nmode = "offline"\n'
        '[sampling]\nmax_tokens = 8\n[[envs]]\nid = "reverse-text"\nargs = { num_examples = 3, seed = 7 }\n'
        "rollouts_per_example = 2\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [str(BIN / "eval"), "@", str(config), "--weights.run-dir", str(run_dir), "--weights.include-base"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("eval v")]
    assert [line.split()[1] for line in lines] == ["v0", "v1"], proc.stdout
    assert all("reward/mean" in line and "pass@2" in line and "6 episodes" in line for line in lines)
    metrics = [json.loads(line) for line in (out / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all(
        m["eval/weight_version"] == m["step"] for m in metrics
    )
    assert all(m["eval/reverse-text/off_version_tokens"] == 0 for m in metrics)
    # the env's own values: its reward function `lcs` and its `@vf.metric` `exact`, mean over the episodes
    assert all(
        0 <= m["eval/reverse-text/reward_fn/lcs"] <= 1 and "eval/reverse-text/metric/exact" in m
        for m in metrics
    )
    for version in (0, 1):
        samples = [
            json.loads(x) for x in (out / "eval" / f"samples_v{version}.jsonl").read_text().splitlines()
        ]
        assert len(samples) == 6 and all(s["prompt"].startswith("<|im_start|>") for s in samples)
        assert all(s["version"] == version and isinstance(s["reward"], float) for s in samples)
        assert all(set(s["metrics"]) == {"exact"} and s["rewards"]["lcs"] == s["reward"] for s in samples)
    tables = list((out / "wandb").glob("offline-run-*/files/media/table/eval/samples_*.table.json"))
    assert len(tables) == 2, sorted(p.name for p in (out / "wandb").rglob("*"))
    table = json.loads(tables[0].read_text())
    assert {"prompt", "completion", "reward", "metrics", "rewards"} <= set(table["columns"])
    assert len(table["data"]) == 6
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "configs" / "eval_inference.toml") not in running, "the engine outlived the command"
