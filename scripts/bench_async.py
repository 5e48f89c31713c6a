"""Sync vs async on one config, back to back: where does the step time go, and how close to ideal is async?

Usage: uv run python scripts/bench_async.py [--config configs/tiny/rl.toml] [--steps 12] [--k 1]
           [--out-dir outputs/bench_async] [--skip-steps 2] [extra rl overrides ...]

Runs `rl @ CONFIG` twice with the same overrides, once with `max_off_policy_steps = 0` (synchronous
on-policy, same code path) and once with `max_off_policy_steps = K`, then prints, averaged over the steps
after the warm-up:

    gen      generation time of one batch = sync step - train - sync_weights (sync: nothing overlaps)
    train    trainer `time/train` (+ `time/publish_weights`)
    sync     orchestrator `time/sync_weights`
    ideal    max(gen, train) + sync: the async step if generation and training overlapped perfectly

and the ratios sync/async (the speedup) next to sync/ideal (the ideal speedup) and async/ideal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_rl(config: Path, out_dir: Path, steps: int | None, k: int | None, extra: list[str]) -> float:
    """Run one `rl` job to completion (`steps`, `k`: None keeps the config's); returns its wall time.
    Raises SystemExit on a non-zero exit."""
    command = [*_rl_command(), "@", str(config), "--output-dir", str(out_dir), "--no-wandb.enabled"]
    if steps is not None:
        command += ["--max-steps", str(steps)]
    if k is not None:
        command += ["--orchestrator.max-off-policy-steps", str(k)]
    command += extra
    print(f"$ {' '.join(command)}", flush=True)
    start = time.monotonic()
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise SystemExit(f"rl run {out_dir} failed with status {result.returncode} (logs: {out_dir}/logs)")
    return time.monotonic() - start


def _rl_command() -> list[str]:
    script = Path(sys.executable).parent / "rl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prime_async.entrypoints.rl"]


def mean_metric(path: Path, key: str, skip_steps: int) -> float:
    values = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["step"] >= skip_steps and record.get(key) is not None:
            values.append(float(record[key]))
    if not values:
        raise SystemExit(f"{path}: no values of {key} after step {skip_steps}")
    return statistics.fmean(values)


def summarize(run_dir: Path, skip_steps: int) -> dict[str, float]:
    orch = run_dir / "metrics" / "orchestrator.jsonl"
    trainer = run_dir / "metrics" / "trainer.jsonl"
    train = mean_metric(trainer, "time/train", skip_steps)
    publish = mean_metric(trainer, "time/publish_weights", skip_steps)
    return {
        "step": mean_metric(orch, "time/step", skip_steps),
        "train": train + publish,
        "sync_weights": mean_metric(orch, "time/sync_weights", skip_steps),
        "staleness": mean_metric(orch, "rollout/data_staleness/mean", skip_steps),
    }


def report(sync: dict[str, float], asyn: dict[str, float], k: int) -> None:
    gen = max(sync["step"] - sync["train"] - sync["sync_weights"], 0.0)
    ideal = max(gen, asyn["train"]) + asyn["sync_weights"]
    rows = [
        ("generation time / batch (s)", gen),
        ("training time / step (s)", asyn["train"]),
        ("sync_weights (s)", asyn["sync_weights"]),
        ("sync step time (s)", sync["step"]),
        (f"async step time, K={k} (s)", asyn["step"]),
        ("ideal async step max(gen, train) + sync (s)", ideal),
        ("speedup sync/async", sync["step"] / asyn["step"]),
        ("ideal speedup sync/ideal", sync["step"] / ideal),
        ("async/ideal", asyn["step"] / ideal),
        ("speedup as a fraction of ideal", (sync["step"] / asyn["step"]) / (sync["step"] / ideal)),
        ("mean staleness sync / async", sync["staleness"]),
        ("", asyn["staleness"]),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Sync vs async step-time benchmark of one rl config.")
    parser.add_argument("--config", type=Path, default=Path("configs/tiny/rl.toml"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--k", type=int, default=1, help="max_off_policy_steps of the async run")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_async"))
    parser.add_argument("--skip-steps", type=int, default=2, help="warm-up steps left out of the means")
    args, extra = parser.parse_known_args()
    walls = {}
    for name, k in (("sync", 0), (f"async-k{args.k}", args.k)):
        walls[name] = run_rl(args.config, args.out_dir / name, args.steps, k, extra)
    sync = summarize(args.out_dir / "sync", args.skip_steps)
    asyn = summarize(args.out_dir / f"async-k{args.k}", args.skip_steps)
    print(f"\nwall time: sync {walls['sync']:.1f} s, async {walls[f'async-k{args.k}']:.1f} s")
    report(sync, asyn, args.k)


if __name__ == "__main__":
    main()
