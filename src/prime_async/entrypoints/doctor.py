"""`uv run doctor @ rl.toml [--env my-env] [--key value ...]`: check an environment before a run.

Runs a few episodes of every training env of the config on version 0 and checks: tokens round-trip
exactly through every turn, the same seed gives the same reward, the longest prompt fits `seq_len`, engine
and trainer logprobs agree, and K = 0 equals the synchronous path over a few steps (`prime_async.doctor`).
Prints a pass/fail table with the fix of each failure; exits 1 when a check failed. Its runs go to
`<output_dir>-doctor`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prime_async.doctor.run import DoctorOptions


def _parser() -> argparse.ArgumentParser:
    defaults = DoctorOptions()
    parser = argparse.ArgumentParser(
        prog="doctor",
        description="Check an environment before a run. Other arguments are rl's (`@ rl.toml --key value`).",
    )
    parser.add_argument("--env", help="check this env id (sets orchestrator.env.id)")
    parser.add_argument("--examples", type=int, default=defaults.examples, help="examples run once per env")
    parser.add_argument(
        "--longest", type=int, default=defaults.longest, help="largest tasks run once per env"
    )
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="examples run twice, one seed")
    parser.add_argument("--sync-steps", type=int, default=defaults.sync_steps, help="steps of the K = 0 run")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s, help="deadline of each stage")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args, rest = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    from prime_async.config.loader import parse_config
    from prime_async.config.rl import RLConfig
    from prime_async.entrypoints.common import setup_logging
    from prime_async.launcher.child_run import fail, sibling_dir, without_flags

    if args.env:
        rest += ["--orchestrator.env.id", args.env]
    cfg = parse_config(RLConfig, rest, prog="doctor")
    setup_logging(cfg.log, component="doctor")
    from prime_async.doctor.run import doctor

    opts = DoctorOptions(args.examples, args.longest, args.repeats, args.sync_steps, args.timeout_s)
    try:
        report, ok = doctor(cfg, without_flags(rest), sibling_dir(cfg.output_dir, "-doctor"), opts)
    except (RuntimeError, ValueError, OSError, TimeoutError) as e:
        fail("doctor", e)
    print(report, flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
