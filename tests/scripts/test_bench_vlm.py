"""scripts/bench_vlm.py's table on hand-made run directories (`--report-only`): one row per seed and
mode with the reward's first -> last means, images per episode and staleness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _write_run(run: Path, staleness: float, rewards: list[float]) -> None:
    (run / "metrics").mkdir(parents=True)
    rows = [
        {"step": step, "time": 1000.0 + step, "reward/mean": reward, "rollout/images_per_episode": 2.0,
         "rollout/data_staleness/mean": staleness}
        for step, reward in enumerate(rewards)
    ]  # fmt: skip
    (run / "metrics" / "orchestrator.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_only_prints_one_row_per_seed_and_mode(tmp_path: Path) -> None:
    _write_run(tmp_path / "seed0" / "sync", 0.0, [0.3, 0.3, 0.4, 0.5, 0.5])
    _write_run(tmp_path / "seed0" / "async", 1.0, [0.35, 0.35, 0.4, 0.45, 0.45])
    cmd = [sys.executable, str(REPO / "scripts/bench_vlm.py"), "--report-only", "--seeds", "0",
           "--steps", "5", "--window", "2", "--out-dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "| 0 | sync (K = 0) | 5 | 0.300 -> 0.500 (+0.200) | 2.0 | 0.00 | - |" in out
    assert "| 0 | async (config's K) | 5 | 0.350 -> 0.450 (+0.100) | 2.0 | 1.00 | - |" in out
