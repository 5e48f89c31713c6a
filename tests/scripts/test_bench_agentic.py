"""scripts/bench_agentic.py's report on hand-made run directories: speed-up, fractions, staleness, the two
time-to-reward definitions and the episode length quantiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _write_run(run: Path, k: int, step_time: float, rewards: list[float]) -> None:
    (run / "metrics").mkdir(parents=True)
    orch, trainer, episodes = [], [], []
    for step, reward in enumerate(rewards):
        orch.append({
            "step": step, "time": 1000 + step_time * (step + 1), "time/step": step_time,
            "reward/mean": reward,
            "engine/busy_fraction": 0.25 if k == 0 else 0.75, "rollout/trained_groups": 2,
            "rollout/data_staleness/ratio_0": 1.0 if k == 0 else 0.5,
            **({} if k == 0 else {"rollout/data_staleness/ratio_1": 0.5}), "ledger/dropped_stale": float(k),
            "ledger/dispatched": 20.0 * (step + 1), "ledger/cancelled": float(k * step),
            "ledger/prompts_lost": 0.0, "rollout/length_bias": 1.0 - 0.05 * k,
        })  # fmt: skip
        trainer.append({"step": step, "time/wait_for_batch": 3.0 if k == 0 else 1.0, "time/train": 1.0,
                        "time/publish_weights": 0.0})  # fmt: skip
        episodes += [{"status": "ok", "turns": t, "tokens": 50 * t, "seconds": 0.5 * t} for t in (1, 1, 2, 8)]
    for name, rows in (("orchestrator", orch), ("trainer", trainer), ("episodes", episodes)):
        (run / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_of_a_sync_and_an_async_run(tmp_path: Path) -> None:
    rising = [0.2, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8]
    _write_run(tmp_path / "k0", 0, 8.0, rising)
    _write_run(tmp_path / "k2", 2, 2.0, rising)
    cmd = [sys.executable, str(REPO / "scripts/bench_agentic.py"), "--report-only", "--ks", "0", "2",
           "--out-dir", str(tmp_path), "--window", "2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "| turns | 1 | 8 | 8 | 8 |" in out and "| seconds | 0.50 | 4.00 | 4.00 | 4.00 |" in out
    lines = [line for line in out.splitlines() if line.startswith(("| 0 ", "| 2 "))]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in lines}
    sync, asyn = rows["0"], rows["2"]
    assert sync[1:5] == ["8.00", "1.00x", "0.25", "0.75"] and asyn[1:5] == ["2.00", "4.00x", "0.75", "0.50"]
    assert sync[5] == "1.00" and asyn[5] == "0.50/0.50" and asyn[6] == "2"
    # the last row: 14 of 160 trajectories cancelled, no prompt lost, the length bias
    assert sync[7:10] == ["0.0%", "0", "1.00"] and asyn[7:10] == ["8.8%", "0", "0.90"]
    # gain90: target 0.2 + 0.9 * 0.6 = 0.74, first reached by the smoothed curve at step 5: 48 s vs 12 s
    assert (sync[12], asyn[12], asyn[13]) == ("48", "12", "0.25x")
    assert float(asyn[15].rstrip("x")) > 1.0  # more reward in the same time budget
