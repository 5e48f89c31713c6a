"""`uv run plan @ rl.toml [--key value ...]` or `uv run plan --from-run DIR`: pick the async knobs.

Profiles the run (a short `rl` of `--profile-steps` steps into `<output_dir>-plan`; or reads the metrics of
an earlier run with `--from-run`), then simulates candidate settings of K, `max_inflight_groups`,
`max_buffered_groups` and engines per trainer with the measured timings (`prime_async.plan`) and prints
each candidate's predicted step time and staleness, and the recommendation. The candidates' knobs are the
only thing changed: model, environment, batch and sampling stay as profiled.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

PROFILE_STEPS = 16


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plan",
        description="Profile a run (or read one) and simulate candidate async settings. Other arguments "
        "are rl's (`@ rl.toml --key value ...`).",
    )
    parser.add_argument("--from-run", type=Path, help="read this run directory's metrics; no profile run")
    parser.add_argument("--profile-steps", type=int, default=PROFILE_STEPS, help="steps of the profile run")
    parser.add_argument("--profile-timeout-s", type=float, default=600.0, help="deadline of the profile run")
    return parser


def _profile_dir(argv: list[str]) -> Path:
    """`<output_dir>-plan` of the user's config (their `--output_dir` included)."""
    from prime_async.config.loader import parse_config
    from prime_async.config.rl import RLConfig
    from prime_async.launcher.child_run import sibling_dir

    return sibling_dir(parse_config(RLConfig, argv, prog="plan").output_dir, "-plan")


def main(argv: Sequence[str] | None = None) -> None:
    args, rest = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    from prime_async.launcher.child_run import fail, without_flags
    from prime_async.plan.run import plan_run, profile_then_plan

    try:
        if args.from_run is not None:
            print(plan_run(args.from_run))
            return
        run_dir = _profile_dir(rest)
        steps, timeout_s = args.profile_steps, args.profile_timeout_s
        print(profile_then_plan(without_flags(rest), run_dir, steps=steps, timeout_s=timeout_s))
    except (RuntimeError, ValueError, OSError) as e:
        fail("plan", e)


if __name__ == "__main__":
    main()
