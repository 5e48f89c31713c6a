"""`uv run rl-engines add|start|remove|list --run OUTPUT_DIR`: change a running run's engines
(`launcher/engines_command.py`, `docs/elastic.md`). Exits 0 when the change was made, 1 when the
orchestrator refused it (its one line printed), 2 on a bad argument."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from prime_async.orchestrator.engine_requests import DEFAULT_TIMEOUT_S


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl-engines", description="Add or remove an engine of a running run."
    )
    parser.add_argument("op", choices=("add", "start", "remove", "list"), help="what to do")
    parser.add_argument("--run", type=Path, required=True, help="the run's output_dir")
    parser.add_argument("--url", help="the engine's base URL (add, remove)")
    parser.add_argument("--api-key", help="the engine's bearer token (default: the run's inference.api_key)")
    parser.add_argument("--port", type=int, help="start: the new engine's port (default: a free one)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="deadline of the change")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from prime_async.launcher import engines_command
    from prime_async.orchestrator.engine_requests import EngineRequest

    try:
        if args.op == "list":
            print(engines_command.live(args.run))
            return
        if args.op == "start":
            result = engines_command.start(args.run, args.port, args.timeout_s)
        else:
            if not args.url:
                raise ValueError(f"rl-engines {args.op} needs --url")
            request = EngineRequest.parse(
                {"op": args.op, "url": args.url, "api_key": args.api_key, "timeout_s": args.timeout_s}
            )
            result = engines_command.change(args.run, request)
    except ValueError as e:
        print(f"rl-engines: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(result.message)
    if result.engines:
        print("engines: " + ", ".join(result.engines))
    raise SystemExit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
