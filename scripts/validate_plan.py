"""Validate the planner: predicted vs measured step time on real runs (CPU, embedded engine).

    uv run python scripts/validate_plan.py [--only tiny,demo,demo-k0] [--out outputs/validate-plan]

For each config: a profile run of `--profile-steps` steps (what `uv run plan` runs), the planner's
prediction for the config as given, then a separate, longer measured run of the same config; the measured
step time is the mean orchestrator `time/step` after the same warm-up the profile leaves out. Prints one
markdown table (docs/plan-and-doctor.md carries its output). The runs are sequential: on 2 cores two runs at
once would slow each other.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from prime_async.plan.candidates import current_candidate, predict
from prime_async.plan.profile import WARMUP_STEPS, profile_run, read_profile
from prime_async.plan.run import profile, run_config
from prime_async.utils.monitor import read_jsonl

CONFIGS: dict[str, tuple[list[str], int]] = {
    # name: (rl arguments, steps of the measured run)
    "tiny": (["@", "configs/tiny/rl.toml"], 400),  # ~0.1 s steps: long enough that one hiccup weighs little
    "demo": (["@", "configs/echo_text/rl.toml"], 24),
    "demo-k0": (["@", "configs/echo_text/rl.toml", "--orchestrator.max_off_policy_steps", "0"], 24),
}


def measured_step_time(run_dir: Path) -> float:
    orch = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    return statistics.fmean(m["time/step"] for m in orch if m["step"] >= WARMUP_STEPS)


def validate(name: str, out: Path, profile_steps: int, timeout_s: float) -> dict[str, float]:
    argv, steps = CONFIGS[name]
    profile_dir, measured_dir = out / f"{name}-profile", out / f"{name}-measured"
    for d in (profile_dir, profile_dir.with_name(profile_dir.name + "-long"), measured_dir):
        shutil.rmtree(d, ignore_errors=True)
    started = time.monotonic()
    profile_dir = profile(argv, profile_dir, steps=profile_steps, timeout_s=timeout_s)
    profile_read = read_profile(profile_dir)
    cfg = run_config(profile_dir)
    predicted = predict(cfg, profile_read, current_candidate(cfg)).step_time_s
    plan_s = time.monotonic() - started
    profile_run(argv, steps=steps, run_dir=measured_dir, timeout_s=timeout_s)
    measured = measured_step_time(measured_dir)
    return {"predicted": predicted, "measured": measured, "profile_step": profile_read.step_time_s,
            "plan_s": plan_s, "steps": steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated config names")
    parser.add_argument("--out", type=Path, default=Path("outputs/validate-plan"))
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    rows = {
        name: validate(name, args.out, args.profile_steps, args.timeout_s) for name in args.only.split(",")
    }
    print(
        "| config | plan (profile + simulate) | profile step (s) | predicted step (s) | measured step (s), "
        "run | error |\n|---|---|---|---|---|---|"
    )
    for name, r in rows.items():
        err = (r["predicted"] - r["measured"]) / r["measured"]
        print(
            f"| {name} | {r['plan_s']:.0f} s | {r['profile_step']:.3f} | {r['predicted']:.3f} | "
            f"{r['measured']:.3f}, {r['steps']:.0f} steps | {err:+.1%} |"
        )


if __name__ == "__main__":
    main()
