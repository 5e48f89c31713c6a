"""Validate the planner: predicted vs measured step time and staleness on real runs (CPU, embedded engine).

    uv run python scripts/validate_plan.py [--only tiny,demo,demo-k0] [--out outputs/validate-plan]

For each config: a profile run of `--profile-steps` steps (what `uv run plan` runs), the planner's
predictions for every candidate, then separate, longer measured runs of the config as given and of the
candidate the plan recommends (when it is another setting: its flags appended to the same arguments).
Each measured figure is read after the same warm-up the profile leaves out (`plan/validate.py`). Prints
one markdown table (docs/plan-and-doctor.md carries its output). The runs are sequential: on 2 cores two
runs at once would slow each other.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from prime_async.plan.candidates import candidate_grid, predict
from prime_async.plan.profile import profile_run, read_profile
from prime_async.plan.run import profile, run_config
from prime_async.plan.validate import HEADER, Comparison, candidate_argv, measure, to_validate

CONFIGS: dict[str, tuple[list[str], int]] = {
    # name: (rl arguments, steps of the measured runs)
    "tiny": (["@", "configs/tiny/rl.toml"], 400),  # ~0.1 s steps: long enough that one hiccup weighs little
    "demo": (["@", "configs/echo_text/rl.toml"], 24),
    "demo-k0": (["@", "configs/echo_text/rl.toml", "--orchestrator.max_off_policy_steps", "0"], 24),
}


def validate(
    name: str, out: Path, profile_steps: int, timeout_s: float, steps: int | None = None
) -> tuple[list[Comparison], float]:
    """The comparisons of config `name` and the seconds its plan took (profile runs + simulation)."""
    argv, default_steps = CONFIGS[name]
    steps = steps or default_steps
    profile_dir = out / f"{name}-profile"
    for d in (profile_dir, profile_dir.with_name(profile_dir.name + "-long")):
        shutil.rmtree(d, ignore_errors=True)
    started = time.monotonic()
    profile_dir = profile(argv, profile_dir, steps=profile_steps, timeout_s=timeout_s)
    profile_read, cfg = read_profile(profile_dir), run_config(profile_dir)
    print(profile_read.describe(), flush=True)
    predictions = [predict(cfg, profile_read, cand) for cand in candidate_grid(cfg)]
    plan_s = time.monotonic() - started
    comparisons = []
    for label, prediction in to_validate(predictions):
        run_dir = out / f"{name}-{label.replace(' ', '-')}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_argv = argv if prediction.candidate.current else candidate_argv(argv, prediction.candidate)
        profile_run(run_argv, steps=steps, run_dir=run_dir, timeout_s=timeout_s)
        comparisons.append(Comparison(label, prediction, measure(run_dir)))
    return comparisons, plan_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated config names")
    parser.add_argument("--out", type=Path, default=Path("outputs/validate-plan"))
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--steps", type=int, default=None, help="steps of each measured run (default: per config)"
    )
    args = parser.parse_args()
    rows, plans = [], []
    for name in args.only.split(","):
        comparisons, plan_s = validate(name, args.out, args.profile_steps, args.timeout_s, args.steps)
        rows += [c.row(name) for c in comparisons]
        plans.append(f"{name}: plan (profile runs + simulation) {plan_s:.0f} s")
    print("\n".join([HEADER, *rows, "", *plans]))


if __name__ == "__main__":
    main()
