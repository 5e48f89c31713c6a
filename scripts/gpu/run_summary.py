"""One line about a finished `rl` run for scripts/gpu_check.sh's detail column.

    python scripts/gpu/run_summary.py RUN_DIR [--steps N] [--require KEY ...]

Reads RUN_DIR/metrics/trainer.jsonl: trained steps, mean mismatch_kl, and the mean of each required key
(e.g. moe/routing_agreement). Exit status 1, naming the problem, when the run trained fewer than N steps
or a required key is in no row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def summarize(run_dir: Path, steps: int, require: list[str]) -> tuple[str, str | None]:
    """(the line, the problem or None)."""
    path = run_dir / "metrics" / "trainer.jsonl"
    if not path.is_file():
        return f"no {path}", f"{path} missing"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    parts = [f"{len(rows)} steps"]
    problem = None if len(rows) >= steps else f"trained {len(rows)} steps, expected {steps}"
    for key in ["mismatch_kl", *require]:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if values:
            parts.append(f"{key} {statistics.fmean(values):.3g}")
        elif key in require:
            problem = problem or f"{key} in no row of {path}"
    return ", ".join(parts), problem


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--require", nargs="*", default=[])
    args = ap.parse_args()
    line, problem = summarize(args.run_dir, args.steps, args.require)
    print(line if problem is None else f"{line}; {problem}")
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
