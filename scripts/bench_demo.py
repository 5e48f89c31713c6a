"""The demo's learning and its sync vs async time-to-reward over several seeds, side by side in one run.

Usage:
    uv run python scripts/bench_demo.py                       # seeds 0 1 2, configs/echo_text/rl{,_sync}.toml
    uv run python scripts/bench_demo.py --seeds 0 --steps 24 --out-dir outputs/bench_demo [rl overrides ...]

For each seed it runs the sync config (K = 0) and the async config (K from the config) to completion, one
after the other (which goes first alternates by seed, so a drifting machine load does not favour one
side), with `--orchestrator.data.seed S --inference.engine.seed S` and the extra `rl` overrides. Then, per
seed (the figures of `scripts/compare_runs.py`):

    first/last     mean reward of the first and of the last `--window` steps, and the gain (last - first)
    step (s)       mean orchestrator step time after the first step
    target         the sync run's final reward, smoothed over `--window` steps (less `--tolerance`)
    time (s)       wall-clock (since the run's first step started) at which the smoothed reward first
                   reaches the target, and the step; `-` when it never does
    ratio          async time / sync time

and a summary: how many async runs gained at least `--min-gain`, and the mean and the worst time ratio.
`--report-only` recomputes the figures from the run directories of an earlier call (e.g. with another
`--tolerance`). Exits 1 when a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import run_rl
from compare_runs import final_smoothed_reward, load_run, smoothed, time_to_reward

SIDES = ("sync", "async")


@dataclass
class SideResult:
    """One run's learning figures."""

    first: float
    last: float
    step_time: float
    wall: float
    hit_seconds: float | None = None
    hit_step: int | None = None

    @property
    def gain(self) -> float:
        return self.last - self.first


def run_seed(seed: int, args: argparse.Namespace, extra: list[str]) -> dict[str, SideResult]:
    """Both sides of one seed, run in the order of the seed's parity; their figures against the sync
    run's final smoothed reward."""
    walls: dict[str, float] = {side: float("nan") for side in SIDES}
    order = SIDES if seed % 2 == 0 else SIDES[::-1]
    for side in order if not args.report_only else ():
        config = args.sync_config if side == "sync" else args.config
        seeds = ["--orchestrator.data.seed", str(seed), "--inference.engine.seed", str(seed)]
        walls[side] = run_rl(config, args.out_dir / f"seed{seed}" / side, args.steps, None, [*seeds, *extra])
    runs = {side: load_run(args.out_dir / f"seed{seed}" / side) for side in SIDES}
    target = final_smoothed_reward(runs["sync"], args.window) - args.tolerance
    results = {}
    for side, run in runs.items():
        _, rewards = run.series("orchestrator", "reward/mean")
        _, step_times = run.series("orchestrator", "time/step")
        hit = time_to_reward(run, target, args.window)
        results[side] = SideResult(
            first=statistics.fmean(rewards[: args.window]),
            last=statistics.fmean(rewards[-args.window :]),
            step_time=statistics.fmean(step_times[1:] or step_times),
            wall=walls[side],
            hit_seconds=hit.seconds,
            hit_step=hit.step,
        )
    print(f"seed {seed}: target {target:.3f} (sync final, smoothed over {args.window} steps); rewards "
          f"(smoothed) sync {_curve(runs['sync'], args.window)} | async {_curve(runs['async'], args.window)}",
          flush=True)  # fmt: skip
    return results


def _curve(run, window: int) -> str:
    _, rewards = run.series("orchestrator", "reward/mean")
    return " ".join(f"{r:.2f}" for r in smoothed(rewards, window))


def ratio(results: dict[str, SideResult]) -> float | None:
    sync, asyn = results["sync"].hit_seconds, results["async"].hit_seconds
    return asyn / sync if sync and asyn is not None else None


def print_report(all_results: dict[int, dict[str, SideResult]], args: argparse.Namespace) -> None:
    print(f"\n{'seed':>4} {'side':>5} {'wall (s)':>8} {'step (s)':>8} {'first':>6} {'last':>6} {'gain':>6} "
          f"{'time (s)':>8} {'step':>4} {'ratio':>6}")  # fmt: skip
    for seed, results in all_results.items():
        for side, r in results.items():
            hit = "-" if r.hit_seconds is None else f"{r.hit_seconds:.1f}"
            step = "-" if r.hit_step is None else str(r.hit_step)
            rat = ratio(results) if side == "async" else 1.0
            shown = "-" if rat is None else f"{rat:.2f}x"
            print(f"{seed:>4} {side:>5} {r.wall:>8.1f} {r.step_time:>8.2f} {r.first:>6.3f} {r.last:>6.3f} "
                  f"{r.gain:>+6.3f} {hit:>8} {step:>4} {shown:>6}")  # fmt: skip
    gains = [res["async"].gain for res in all_results.values()]
    ratios = [ratio(res) for res in all_results.values()]
    reached = [r for r in ratios if r is not None]
    learned = sum(g >= args.min_gain for g in gains)
    print(f"\nasync runs with gain >= {args.min_gain}: {learned} of {len(gains)}")
    print(f"step time sync/async: {statistics.fmean(_step_ratios(all_results)):.2f} (mean over seeds)")
    if reached:
        print(f"time-to-reward async/sync: mean {statistics.fmean(reached):.2f}x, worst {max(reached):.2f}x "
              f"({len(reached)} of {len(ratios)} async runs reached the sync final)")  # fmt: skip
    else:
        print("time-to-reward: no async run reached the sync run's final reward")


def _step_ratios(all_results: dict[int, dict[str, SideResult]]) -> list[float]:
    return [res["sync"].step_time / res["async"].step_time for res in all_results.values()]


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/echo_text/rl.toml"))
    parser.add_argument("--sync-config", type=Path, default=Path("configs/echo_text/rl_sync.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="max_steps of every run (default: config's)")
    parser.add_argument("--window", type=int, default=5, help="steps of the reward means (>= 1)")
    parser.add_argument("--min-gain", type=float, default=0.3, help="the learning criterion (last - first)")
    parser.add_argument("--tolerance", type=float, default=0.0, help="target = sync final - this")
    parser.add_argument("--report-only", action="store_true", help="no runs: read --out-dir's")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_demo"))
    return parser.parse_known_args()


def main() -> None:
    args, extra = parse_args()
    all_results = {seed: run_seed(seed, args, extra) for seed in args.seeds}
    print_report(all_results, args)


if __name__ == "__main__":
    main()
