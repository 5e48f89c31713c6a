"""A real tiny `rl` run with the health alarms on and `stop_on_alarm` forced by an absurd threshold
(`entropy_drop = 2`: "entropy below twice its first window's", true from the first full window): the
trainer logs the alarm's WARNING and its step's metrics, ends with one error line (exit 2), and `rl`
stops the run and exits non-zero naming the trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_stop_on_alarm_ends_the_run_non_zero_with_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), "--max-steps", "8",
        "--inference.server.port", "0", "--transport.port", "0",
        "--trainer.health.window", "3", "--trainer.health.entropy-drop", "2",
        "--trainer.health.stop-on-alarm", "true",
    ]  # fmt: skip
    run = zygote.run(cmd, cwd=ROOT, timeout=480)
    assert run.returncode != 0, run.stderr[-3000:]
    assert "trainer exited with status 2" in run.stderr, run.stderr[-3000:]
    log = (out / "logs" / "trainer.log").read_text().splitlines()
    warning = [line for line in log if "WARNING" in line and "health alarm entropy_collapse" in line]
    assert len(warning) == 1 and "over steps 0-2" in warning[0] and "alarm when < 2" in warning[0], log[-20:]
    errors = [line for line in log if "trainer: error:" in line]
    assert len(errors) == 1, log[-20:]
    assert "stopped at step 2 by trainer.health.stop_on_alarm: health alarm entropy_collapse" in errors[0]
    rows = [json.loads(line) for line in (out / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the alarm's step is logged before the stop
    assert [r["health/entropy_collapse"] for r in rows] == [0.0, 0.0, 1.0]
