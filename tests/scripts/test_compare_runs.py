"""scripts/compare_runs.py on synthetic metrics files: table values and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _write_run(run_dir: Path, k: int, step_time: float) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "configs").mkdir()
    (run_dir / "configs" / "orchestrator.toml").write_text(f"max_off_policy_steps = {k}\n")
    with (run_dir / "metrics" / "orchestrator.jsonl").open("w") as f:
        for step in range(4):
            record = {
                "step": step,
                "time": 1000 + step_time * (step + 1),
                "time/step": step_time,
                "reward/mean": 0.1 * step,
                "rollout/tokens_per_s": 100.0 / step_time,
                "rollout/data_staleness/mean": 0.0 if k == 0 else 1.0,
            }
            f.write(json.dumps(record) + "\n")
    with (run_dir / "metrics" / "trainer.jsonl").open("w") as f:
        for step in range(4):
            f.write(json.dumps({"step": step, "time": 0, "mismatch_kl": 0.001 * (step + 1)}) + "\n")


def test_compare_runs_prints_table_and_writes_png(tmp_path: Path) -> None:
    _write_run(tmp_path / "a", k=0, step_time=2.0)
    _write_run(tmp_path / "b", k=2, step_time=1.0)
    out = tmp_path / "cmp.png"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "compare_runs.py"),
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("run")
    sync_row, async_row = lines[1].split(), lines[2].split()  # ranges hold spaces: compare prefixes
    assert sync_row[0] == "sync" and sync_row[2] == "2.00" and sync_row[3] == "50"
    assert async_row[0] == "async-k2" and async_row[2] == "1.00" and async_row[4] == "1.00"
    assert "0.100 - 0.300" in lines[1] and "2.00e-03 - 4.00e-03" in lines[2]
    assert out.stat().st_size > 10_000


def test_compare_runs_names_a_missing_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compare_runs.py"), str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "nope" in result.stderr and "no metrics" in result.stderr
