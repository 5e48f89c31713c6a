"""What one run measured, as the simulator needs it: read from a run directory's metrics.

    metrics/episodes.jsonl     `seconds` of every ok episode   ──► latency samples (drawn per episode)
    metrics/trainer.jsonl      time/train + time/publish_weights ──► train time per step
    metrics/orchestrator.jsonl time/sync_weights, time/cut       ──► weight update, batch cut time
                               time/step                         ──► the measured step time

The first `warmup` steps are left out everywhere (process start, first compilation, the first batch that
waits for the whole pipeline to fill): the figures describe the steady state.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WARMUP_STEPS = 2


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Profile:
    """Steady-state timings of one run (seconds)."""

    run_dir: Path
    steps: int
    latency_samples: tuple[float, ...]
    train_time_s: float
    update_time_s: float
    cut_time_s: float
    step_time_s: float  # measured: mean orchestrator time/step after the warm-up

    def describe(self) -> str:
        lat = sorted(self.latency_samples)
        return (
            f"profile of {self.run_dir} ({self.steps} steps): episode p50 {_q(lat, 0.5):.3f}s "
            f"p90 {_q(lat, 0.9):.3f}s ({len(lat)} episodes), train {self.train_time_s:.3f}s/step, "
            f"weight update {self.update_time_s:.3f}s, batch cut {self.cut_time_s:.3f}s, "
            f"measured step {self.step_time_s:.3f}s"
        )


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def read_profile(run_dir: Path, *, warmup: int = WARMUP_STEPS) -> Profile:
    """The steady-state figures of the run in `run_dir` (module docstring). Raises ValueError naming the
    file when the run has no steady state to read."""
    metrics = run_dir / "metrics"
    orch = [m for m in read_jsonl(metrics / "orchestrator.jsonl") if m["step"] >= warmup]
    trainer = [m for m in read_jsonl(metrics / "trainer.jsonl") if m["step"] >= warmup]
    if not orch or not trainer:
        raise ValueError(
            f"{metrics}: no orchestrator/trainer steps after the first {warmup} (a run of at least "
            f"{warmup + 3} steps is needed to profile)"
        )
    start = min(m["time"] for m in trainer) - _median([m["time/step"] for m in orch])
    episodes = [
        e for e in read_jsonl(metrics / "episodes.jsonl") if e["status"] == "ok" and e["time"] >= start
    ]
    if not episodes:
        raise ValueError(f"{metrics / 'episodes.jsonl'}: no ok episode finished after the warm-up")
    updates = [m["time/sync_weights"] for m in orch if m.get("time/sync_weights", 0) > 0]
    return Profile(
        run_dir=run_dir,
        steps=len(orch) + warmup,
        latency_samples=tuple(e["seconds"] for e in episodes),
        train_time_s=_median([m["time/train"] + m.get("time/publish_weights", 0.0) for m in trainer]),
        update_time_s=_median(updates),
        cut_time_s=_median([m.get("time/cut", 0.0) for m in orch]),
        step_time_s=statistics.fmean(m["time/step"] for m in orch),
    )


def profile_run(rl_argv: list[str], *, steps: int, run_dir: Path, timeout_s: float) -> Path:
    """Run `rl` with the user's arguments for `steps` steps into `run_dir` (wandb off); return `run_dir`.
    The run's console output streams through; past `timeout_s` it is stopped and an error names it."""
    cmd = [sys.executable, "-m", "prime_async.entrypoints.rl", *rl_argv, "--max_steps", str(steps),
           "--output_dir", str(run_dir), "--wandb.enabled", "false"]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(cmd)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(timeout=60)
        raise RuntimeError(
            f"plan: the profile run (rl, {steps} steps) did not finish in {timeout_s:.0f}s; plan waited on "
            f"it: see {run_dir}/logs"
        ) from None
    if rc != 0:
        raise RuntimeError(f"plan: the profile run exited {rc}: see {run_dir}/logs")
    print(f"plan: profile run of {steps} steps took {time.monotonic() - started:.0f}s", flush=True)
    return run_dir
