"""scripts/bench_agentic.py's report on hand-made run directories (`OUT/<workload>/k<K>`): the per-K table
(speed-up, throughput bound, gain90, token shares discarded by reason, length bias and its low bound, token
staleness; "-" where a run predates a metric), the details table, the episode length quantiles, workloads
without runs, and the load verdicts a run left (refused, or printed under the LOADED line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RISING = [0.2, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8]


def _orch_row(k: int, step: int, step_time: float, reward: float) -> dict:
    row = {
        "step": step, "time": 1000 + step_time * (step + 1), "time/step": step_time, "reward/mean": reward,
        "engine/busy_fraction": 0.25 if k == 0 else 0.75, "rollout/trained_groups": 2,
        "rollout/trained_completion_tokens": 100.0, "rollout/data_staleness/ratio_0": 1.0 if k == 0 else 0.5,
        "ledger/dropped_stale": float(k), "ledger/dispatched": 20.0 * (step + 1),
        "ledger/cancelled": float(k * step), "ledger/prompts_lost": 0.0,
        "rollout/length_bias": 1.0 - 0.05 * k,
    }  # fmt: skip
    if k:  # the async run has the newer metrics, the sync run predates them
        row |= {"rollout/data_staleness/ratio_1": 0.5, "rollout/length_bias/low": 0.8,
                "rollout/token_staleness/mean": 0.5 + 0.5 * (step % 2), "rollout/token_staleness/max": 2.0,
                "ledger/tokens/generated": 1000.0, "ledger/tokens/trained": 850.0,
                "ledger/tokens/masked_stale": 50.0, "ledger/tokens/dropped_stale": 0.0,
                "ledger/tokens/cancelled": 100.0, "ledger/tokens/filtered": 0.0,
                "ledger/tokens/errored": 0.0}  # fmt: skip
    return row


def _write_run(run: Path, k: int, step_time: float, rewards: list[float]) -> None:
    (run / "metrics").mkdir(parents=True)
    orch = [_orch_row(k, step, step_time, reward) for step, reward in enumerate(rewards)]
    trainer = [{"step": step, "time/wait_for_batch": 3.0 if k == 0 else 1.0, "time/train": 1.0,
                "time/publish_weights": 0.0} for step in range(len(rewards))]  # fmt: skip
    episodes = [{"status": "ok", "turns": t, "tokens": 50 * t, "seconds": 0.5 * t} for t in (1, 1, 2, 8)]
    for name, rows in (("orchestrator", orch), ("trainer", trainer), ("episodes", episodes * len(rewards))):
        (run / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _bench(out_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(REPO / "scripts/bench_agentic.py"), "--report-only", "--ks", "0", "2",
           "--out-dir", str(out_dir), "--window", "2", *flags]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _rows(out: str, header: str) -> dict[str, list[str]]:
    """The rows of the table whose header line starts with `header`, by K."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0]] = cells
    return rows


def test_report_of_a_sync_and_an_async_run(tmp_path: Path) -> None:
    _write_run(tmp_path / "lookup_agent" / "k0", 0, 8.0, RISING)
    _write_run(tmp_path / "lookup_agent" / "k2", 2, 2.0, RISING)
    result = _bench(tmp_path, "--workloads", "lookup_agent", "echo_long")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "load average:" in out.splitlines()[0]
    assert "skipping workload echo_long: no runs in" in out and "## echo_long" not in out
    assert "load not measured for lookup_agent K = 0, lookup_agent K = 2" in out
    assert "| turns | 1 | 8 | 8 | 8 |" in out and "| seconds | 0.50 | 4.00 | 4.00 | 4.00 |" in out
    rows = _rows(out, "| K | step (s) |")
    sync, asyn = rows["0"], rows["2"]
    # bound: sync step 8 / max(generation 0.25 x 8 = 2 s, trainer 1 s) = 4x, the same on every row;
    # gain90: target 0.2 + 0.9 * 0.6 = 0.74, first reached by the smoothed curve at step 5: 48 s vs 12 s
    assert sync[1:5] == ["8.00", "1.00x", "4.00x", "1.00x"]
    assert asyn[1:5] == ["2.00", "4.00x", "4.00x", "0.25x"]
    assert sync[5] == asyn[5] == "0.800 +- 0.000" and (sync[6], asyn[6]) == ("0.25", "0.75")
    # discarded tokens by reason: masked stale, dropped stale, cancelled, filtered, errored (of 1000)
    assert sync[7:12] == ["-"] * 5 and asyn[7:12] == ["5.0%", "0.0%", "10.0%", "0.0%", "0.0%"]
    assert sync[12:] == ["0", "1.00", "-"] and asyn[12:] == ["0", "0.90 (low 0.80)", "0.75 (max 2)"]
    details = _rows(out, "| K | trainer idle |")
    assert details["0"][1:6] == ["0.75", "1.00", "1.00", "0", "0.0%"]
    # the last row: 14 of 160 trajectories cancelled
    assert details["2"][1:6] == ["0.50", "1.00", "0.50/0.50", "2", "8.8%"]
    assert (details["0"][7], details["2"][7]) == ("48", "12") and details["2"][10] == "-"
    assert float(details["2"][9].rstrip("x")) > 1.0  # more reward in the same time budget


def _loaded_report() -> dict:
    return {"seconds": 60.0, "other_cores": 0.9, "own_cores": 1.0, "machine_cores": 1.9, "hidden_core_s": 0.0,
            "peak_seconds": 60.0, "loaded": True,
            "reason": "other processes used 0.90 cores on average over 60 s (limit 0.25)",
            "others_top": [[4242, "pytest", 54.0]], "own_top": [], "samples": [0.9]}  # fmt: skip


def test_report_of_a_run_measured_loaded(tmp_path: Path) -> None:
    for k, step_time in ((0, 8.0), (2, 2.0)):
        _write_run(tmp_path / "lookup_agent" / f"k{k}", k, step_time, RISING)
    quiet = {**_loaded_report(), "other_cores": 0.01, "loaded": False, "reason": "", "others_top": []}
    (tmp_path / "lookup_agent" / "k0" / "bench_load.json").write_text(json.dumps({"before": quiet}))
    loads = {"before": quiet, "during": _loaded_report()}
    (tmp_path / "lookup_agent" / "k2" / "bench_load.json").write_text(json.dumps(loads))
    refused = _bench(tmp_path, "--workloads", "lookup_agent")
    assert refused.returncode == 3 and "speed-up" not in refused.stdout and "x |" not in refused.stdout
    (line,) = refused.stderr.splitlines()
    assert "loaded during lookup_agent K = 2" in line and "pid 4242 (pytest) 54.0 core-s" in line
    allowed = _bench(tmp_path, "--workloads", "lookup_agent", "--allow-loaded")
    assert allowed.returncode == 0, allowed.stderr
    assert "LOADED MACHINE: ratios not trustworthy (lookup_agent K = 2, during:" in allowed.stdout
    assert allowed.stdout.rstrip().endswith("LOADED MACHINE: ratios not trustworthy")
    assert _rows(allowed.stdout, "| K | trainer idle |")["2"][10] == "0.01/0.90"
