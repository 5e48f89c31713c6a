"""The tiny VLM's learning, sync vs async: does the reward of `configs/tiny/rl_vlm.toml` move, per seed?

Usage: uv run python scripts/bench_vlm.py [--config configs/tiny/rl_vlm.toml] [--seeds 0 1] [--steps 24]
           [--window 3] [--out-dir outputs/bench_vlm] [--report-only] [extra rl overrides ...]

For each seed it runs the config twice to completion, one run after the other (which goes first alternates
by seed): sync (`max_off_policy_steps = 0`) and async (the config's K), with `--orchestrator.data.seed S
--inference.engine.seed S` and the extra `rl` overrides. Then it prints one row per run (the table of
docs/vlm.md):

    first -> last   mean `reward/mean` of the first and of the last `--window` steps
    images/episode  mean `rollout/images_per_episode`
    wall (s)        the `rl` command's wall time (start-up included)

`--report-only` recomputes the table from the run directories of an earlier call. Exits 1 when a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import run_rl
from compare_runs import load_run

SIDES = ("sync", "async")


def run_seed(seed: int, args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    """Both sides of one seed (order by the seed's parity); their wall times (NaN with --report-only)."""
    walls = {side: float("nan") for side in SIDES}
    order = SIDES if seed % 2 == 0 else SIDES[::-1]
    for side in order if not args.report_only else ():
        seeds = ["--orchestrator.data.seed", str(seed), "--inference.engine.seed", str(seed)]
        k = 0 if side == "sync" else None
        walls[side] = run_rl(
            args.config, args.out_dir / f"seed{seed}" / side, args.steps, k, [*seeds, *extra]
        )
    return walls


def row(seed: int, side: str, wall: float, args: argparse.Namespace) -> str:
    """One table row of a finished run: seed, mode, reward first -> last, images per episode, wall."""
    run = load_run(args.out_dir / f"seed{seed}" / side)
    steps, rewards = run.series("orchestrator", "reward/mean")
    _, images = run.series("orchestrator", "rollout/images_per_episode")
    _, off_policy = run.series("orchestrator", "rollout/data_staleness/mean")
    if not rewards:
        raise SystemExit(f"{args.out_dir}/seed{seed}/{side}: no reward/mean in its metrics")
    first, last = statistics.fmean(rewards[: args.window]), statistics.fmean(rewards[-args.window :])
    mode = "sync (K = 0)" if side == "sync" else "async (config's K)"
    shown_wall = "-" if wall != wall else f"{wall:.0f}"
    img = f"{statistics.fmean(images):.1f}" if images else "-"
    stale = f"{statistics.fmean(off_policy):.2f}" if off_policy else "-"
    return (
        f"| {seed} | {mode} | {len(steps)} | {first:.3f} -> {last:.3f} ({last - first:+.3f}) | {img} | "
        f"{stale} | {shown_wall} |"
    )


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiny/rl_vlm.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=24, help="max_steps of every run")
    parser.add_argument("--window", type=int, default=3, help="steps of the first/last reward means (>= 1)")
    parser.add_argument("--report-only", action="store_true", help="no runs: read --out-dir's")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_vlm"))
    return parser.parse_known_args()


def main() -> None:
    args, extra = parse_args()
    walls = {seed: run_seed(seed, args, extra) for seed in args.seeds}
    print(f"\n{args.config}, {args.steps} steps, reward means over the first/last {args.window} steps\n")
    print("| seed | mode | steps | reward first -> last | images / episode | staleness (mean) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for seed, by_side in walls.items():
        for side in SIDES:
            print(row(seed, side, by_side[side], args))


if __name__ == "__main__":
    main()
