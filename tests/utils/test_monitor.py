"""Monitor: evaluations are logged by weights version in their own file, next to the component's steps,
and reach the same (offline) wandb run with a samples table."""

from __future__ import annotations

import json
from pathlib import Path

from prime_async.config.shared import WandbConfig
from prime_async.utils.monitor import Monitor


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_lines_are_keyed_by_version_and_leave_the_step_file_alone(tmp_path: Path) -> None:
    monitor = Monitor(output_dir=tmp_path, name="orchestrator", wandb_cfg=WandbConfig(mode="offline"))
    monitor.log({"reward/mean": 0.1}, step=0)
    monitor.log_eval({"eval/a/reward/mean": 0.2}, version=0)
    monitor.log({"reward/mean": 0.3}, step=1)
    monitor.log({"reward/mean": 0.4}, step=2)
    monitor.log_eval({"eval/a/reward/mean": 0.5}, version=1)  # finished two steps after its version
    assert monitor.log_table("eval/samples", [{"prompt": "p", "completion": "c", "reward": 1.0}])
    monitor.close()
    steps = lines(tmp_path / "metrics" / "orchestrator.jsonl")
    assert [m["step"] for m in steps] == [0, 1, 2] and not any("eval/a/reward/mean" in m for m in steps)
    evals = lines(tmp_path / "metrics" / "eval.jsonl")
    assert [(m["step"], m["eval/weight_version"], m["eval/a/reward/mean"]) for m in evals] == [
        (0, 0, 0.2), (1, 1, 0.5),
    ]  # fmt: skip
    assert list(tmp_path.glob("wandb/offline-run-*/files/media/table/eval/samples_*.table.json"))


def test_without_wandb_a_table_is_not_logged(tmp_path: Path) -> None:
    monitor = Monitor(output_dir=tmp_path, name="eval", wandb_cfg=WandbConfig(enabled=False))
    monitor.log({"eval/a/reward/mean": 0.2}, step=3)
    assert not monitor.log_table("eval/samples", [{"prompt": "p"}])
    monitor.close()
    assert [m["step"] for m in lines(tmp_path / "metrics" / "eval.jsonl")] == [3]
