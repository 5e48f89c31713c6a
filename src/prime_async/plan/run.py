"""The planner end to end: profile (or read) a run, simulate the candidates, render the report."""

from __future__ import annotations

import math
import time
from pathlib import Path

from prime_async.config.loader import load_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.plan.candidates import candidate_grid, predict
from prime_async.plan.profile import WARMUP_STEPS, profile_run, read_profile
from prime_async.plan.report import recommendation, render

MIN_WINDOW_S = 30.0  # seconds of steady state a profile should cover
MAX_PROFILE_STEPS = 500


def run_config(run_dir: Path) -> OrchestratorConfig:
    """The orchestrator config the run in `run_dir` ran with (its resolved `configs/orchestrator.toml`)."""
    path = run_dir / "configs" / "orchestrator.toml"
    if not path.exists():
        raise FileNotFoundError(f"plan: {path} is missing: --from-run needs the directory of an rl run")
    return load_config(OrchestratorConfig, ["@", str(path)])


def plan_run(run_dir: Path) -> str:
    """Read the run's profile and config, simulate every candidate, return the report."""
    started = time.monotonic()
    profile = read_profile(run_dir)
    cfg = run_config(run_dir)
    predictions = [predict(cfg, profile, cand) for cand in candidate_grid(cfg)]
    return "\n".join(
        [
            profile.describe(),
            render(predictions, profile.step_time_s),
            recommendation(predictions),
            f"plan: {len(predictions)} candidates simulated in {time.monotonic() - started:.1f}s",
        ]
    )


def profile(rl_argv: list[str], run_dir: Path, *, steps: int, timeout_s: float) -> Path:
    """Profile `steps` steps into `run_dir`; when its steady state lasted less than `MIN_WINDOW_S` (steps
    of a fraction of a second: one hiccup would weigh a lot), profile again long enough for it, into
    `<run_dir>-long`. The run directory to read."""
    print(f"plan: profiling {steps} steps into {run_dir}", flush=True)
    profile_run(rl_argv, steps=steps, run_dir=run_dir, timeout_s=timeout_s)
    step_s = read_profile(run_dir).step_time_s
    window = step_s * (steps - WARMUP_STEPS)
    if window >= MIN_WINDOW_S:
        return run_dir
    longer = min(MAX_PROFILE_STEPS, WARMUP_STEPS + math.ceil(MIN_WINDOW_S / max(step_s, 1e-3)))
    print(f"plan: {window:.1f}s of steady state is too short to read; profiling {longer} steps", flush=True)
    long_dir = run_dir.with_name(run_dir.name + "-long")
    profile_run(rl_argv, steps=longer, run_dir=long_dir, timeout_s=timeout_s)
    return long_dir


def profile_then_plan(rl_argv: list[str], run_dir: Path, *, steps: int, timeout_s: float) -> str:
    return plan_run(profile(rl_argv, run_dir, steps=steps, timeout_s=timeout_s))
