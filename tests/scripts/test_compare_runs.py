"""scripts/compare_runs.py on hand-made metrics files: table values, time-to-reward and the PNG."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

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


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare_runs", REPO / "scripts" / "compare_runs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_runs"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _write_rewards(run_dir: Path, k: int, step_time: float, rewards: list[float]) -> None:
    """A run whose step n ends at (n + 1) * step_time seconds after its first step started."""
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "configs").mkdir()
    (run_dir / "configs" / "orchestrator.toml").write_text(f"max_off_policy_steps = {k}\n")
    lines = [
        json.dumps({"step": n, "time": 500 + step_time * (n + 1), "time/step": step_time, "reward/mean": r})
        for n, r in enumerate(rewards)
    ]
    (run_dir / "metrics" / "orchestrator.jsonl").write_text("\n".join(lines) + "\n")


def test_time_to_reward_on_hand_made_runs(tmp_path: Path) -> None:
    cr = _load_script()
    assert cr.smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    # sync: 10 s steps; trailing 2-step means 0.1, 0.15, 0.25, 0.4, 0.55 -> target = final = 0.55
    _write_rewards(tmp_path / "sync", k=0, step_time=10.0, rewards=[0.1, 0.2, 0.3, 0.5, 0.6])
    # async: 6 s steps; smoothed 0.1, 0.2, 0.35, 0.5, 0.6 -> first >= 0.55 at step 4, ending at 30 s
    _write_rewards(tmp_path / "async", k=1, step_time=6.0, rewards=[0.1, 0.3, 0.4, 0.6, 0.6, 0.7])
    # never: stays below the target
    _write_rewards(tmp_path / "never", k=2, step_time=1.0, rewards=[0.2, 0.2, 0.2])
    sync, fast, never = (cr.load_run(tmp_path / name) for name in ("sync", "async", "never"))
    assert cr.final_smoothed_reward(sync, 2) == pytest.approx(0.55)
    assert cr.time_to_reward(sync, 0.55, 2) == cr.TimeToReward(step=4, seconds=50.0)
    assert cr.time_to_reward(fast, 0.55, 2) == cr.TimeToReward(step=4, seconds=30.0)
    assert cr.time_to_reward(never, 0.55, 2) == cr.TimeToReward(step=None, seconds=None)
    rows = cr.time_to_reward_rows([fast, never, sync], 2)  # the sync run is the reference wherever it is
    by_run = {row["run"]: row for row in rows}
    assert by_run["sync"]["time to target (s)"] == "50.0" and by_run["sync"]["ratio"] == "1.00x"
    assert by_run["async-k1"]["time to target (s)"] == "30.0" and by_run["async-k1"]["ratio"] == "0.60x"
    assert by_run["async-k1"]["reward first 2"] == "0.200" and by_run["async-k1"]["reward last 2"] == "0.650"
    assert by_run["async-k2"]["step"] == "-" and by_run["async-k2"]["ratio"] == "-"
    assert {row["target"] for row in rows} == {"0.550"}


def test_compare_runs_prints_the_time_to_reward_table(tmp_path: Path) -> None:
    _write_rewards(tmp_path / "a", k=0, step_time=10.0, rewards=[0.1, 0.2, 0.3, 0.5, 0.6])
    _write_rewards(tmp_path / "b", k=1, step_time=6.0, rewards=[0.1, 0.3, 0.4, 0.6, 0.6, 0.7])
    script = str(REPO / "scripts" / "compare_runs.py")
    args = [sys.executable, script, str(tmp_path / "a"), str(tmp_path / "b"), "--window", "2"]
    result = subprocess.run([*args, "--out", str(tmp_path / "c.png")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[:3] == ["run", "reward", "first"]
    assert table[1].split() == ["sync", "0.150", "0.550", "0.550", "50.0", "4", "1.00x"]
    assert table[2].split() == ["async-k1", "0.200", "0.650", "0.550", "30.0", "4", "0.60x"]
    bad = subprocess.run([*args[:-1], "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--window must be >= 1" in bad.stderr
