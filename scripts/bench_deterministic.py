"""Throughput cost of `deterministic = true` against the default scheduling, on one config, side by side.

Usage: uv run python scripts/bench_deterministic.py [--config configs/tiny/rl.toml] [--steps 10]
           [--skip-steps 2] [--out-dir outputs/bench_deterministic] [extra rl overrides ...]

Runs `rl @ CONFIG` twice with the same overrides, back to back: default scheduling, then
`--deterministic true`. Printed for each, over the steps after the warm-up (`--skip-steps`):

    step s     orchestrator `time/step` (time between two batch cuts: the run's pace)
    rollout    completion tokens generated per second of step time (trained tokens / step time)
    train      trainer `time/train`
    sync       orchestrator `time/sync_weights` (deterministic: drained, version-by-version loads)
    wall s     the whole `rl` command, start-up included

and the cost: deterministic step time / default step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _rl_command() -> list[str]:
    script = Path(sys.executable).parent / "rl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prime_async.entrypoints.rl"]


def run_rl(config: Path, out_dir: Path, steps: int, extra: list[str]) -> float:
    """Run one `rl` job to completion; returns its wall time. Raises on a non-zero exit."""
    ports = ["--inference.server.port", "0", "--transport.port", "0"]
    command = [*_rl_command(), "@", str(config), "--max-steps", str(steps), "--output-dir", str(out_dir),
               "--no-wandb.enabled", *ports, *extra]  # fmt: skip
    print(f"$ {' '.join(command)}", flush=True)
    start = time.monotonic()
    result = subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    if result.returncode != 0:
        raise SystemExit(f"rl failed with status {result.returncode} (logs: {out_dir}/logs)")
    return time.monotonic() - start


def _rows(path: Path, skip_steps: int) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if row["step"] >= skip_steps]
    if not kept:
        raise SystemExit(f"{path}: no step after the {skip_steps} warm-up steps; raise --steps")
    return kept


def summarize(run_dir: Path, skip_steps: int, wall_s: float) -> dict[str, float]:
    orch = _rows(run_dir / "metrics" / "orchestrator.jsonl", skip_steps)
    trainer = _rows(run_dir / "metrics" / "trainer.jsonl", skip_steps)
    step_s = statistics.fmean(r["time/step"] for r in orch)
    tokens = statistics.fmean(r["rollout/trained_completion_tokens"] for r in orch)
    return {
        "step_s": step_s,
        "rollout_tok_s": tokens / step_s if step_s > 0 else float("nan"),
        "train_s": statistics.fmean(r["time/train"] for r in trainer),
        "sync_s": statistics.fmean(r["time/sync_weights"] for r in orch),
        "wall_s": wall_s,
        "reward": orch[-1]["reward/mean"],
    }


def report(default: dict[str, float], determ: dict[str, float]) -> None:
    cols = [("step s", "step_s", "{:.3f}"), ("rollout tok/s", "rollout_tok_s", "{:.1f}"),
            ("train s", "train_s", "{:.3f}"), ("sync s", "sync_s", "{:.3f}"), ("wall s", "wall_s", "{:.1f}"),
            ("reward (last)", "reward", "{:.3f}")]  # fmt: skip
    print(f"\n{'':15}" + "".join(f"{name:>15}" for name, _, _ in cols))
    for label, row in (("default", default), ("deterministic", determ)):
        print(f"{label:15}" + "".join(f"{fmt.format(row[key]):>15}" for _, key, fmt in cols))
    cost = determ["step_s"] / default["step_s"] if default["step_s"] > 0 else float("nan")
    print(f"\ndeterministic step time = {cost:.2f} x default (throughput {1 / cost:.0%} of default)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=Path("configs/tiny/rl.toml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-steps", type=int, default=2, help="warm-up steps left out of the means")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_deterministic"))
    args, extra = parser.parse_known_args()
    results = {}
    for label, flags in (("default", []), ("deterministic", ["--deterministic", "true"])):
        out = args.out_dir / label
        wall = run_rl(args.config, out, args.steps, [*extra, *flags])
        results[label] = summarize(out, args.skip_steps, wall)
    report(results["default"], results["deterministic"])


if __name__ == "__main__":
    main()
