"""Compare runs side by side from their metrics JSONL files (sync vs async, or several K).

Usage: uv run python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] [--out compare.png] [--skip-steps 1]
       [--window 5]

Reads `RUN_DIR/metrics/{orchestrator,trainer}.jsonl`, writes one PNG with step time, reward vs
wall-clock, reward vs step, staleness and mismatch KL, and prints a table like the RLinf seed's:
mean step time, throughput (tokens/s), mean staleness, reward range, mismatch KL range.
The first `--skip-steps` steps (warm-up) are left out of the table, as in the seed.

A second table compares learning by wall-clock: the target is the reference run's final smoothed reward
(trailing mean of `reward/mean` over `--window` steps; the reference is the sync run, K = 0, else the
first RUN_DIR), and each run's time-to-reward is the wall-clock (seconds since its first step started)
at the end of the first step whose smoothed reward reaches the target; the ratio is that time over the
reference's. It also gives the mean reward of the first and of the last `--window` steps. `--tolerance T`
counts a run as there once its smoothed reward is within T of the target (default 0: the strict
definition; a reference that ends at the reward's ceiling, e.g. five perfect steps, is otherwise reached
only by a run with five perfect steps too).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunMetrics:
    """The series of one run, keyed by step."""

    name: str
    orchestrator: list[dict[str, Any]] = field(default_factory=list)
    trainer: list[dict[str, Any]] = field(default_factory=list)

    def series(self, source: str, key: str) -> tuple[list[int], list[float]]:
        records = self.orchestrator if source == "orchestrator" else self.trainer
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        return [p[0] for p in points], [float(p[1]) for p in points]

    def wall_clock(self) -> dict[int, float]:
        if not self.orchestrator:
            return {}
        start = self.orchestrator[0]["time"] - float(self.orchestrator[0].get("time/step") or 0.0)
        return {r["step"]: r["time"] - start for r in self.orchestrator}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(run_dir: Path) -> RunMetrics:
    run = RunMetrics(name=_run_name(run_dir))
    run.orchestrator = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    run.trainer = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    if not run.orchestrator and not run.trainer:
        raise ValueError(f"{run_dir}: no metrics/orchestrator.jsonl or metrics/trainer.jsonl")
    return run


def _run_name(run_dir: Path) -> str:
    config = run_dir / "configs" / "orchestrator.toml"
    if config.exists():
        import tomllib

        k = tomllib.loads(config.read_text()).get("max_off_policy_steps")
        if k is not None:
            return "sync" if k == 0 else f"async-k{k}"
    return run_dir.name


def summarize(run: RunMetrics, skip_steps: int) -> dict[str, str]:
    """One table row: the seed's columns computed over steps >= skip_steps."""

    def values(source: str, key: str) -> list[float]:
        steps, ys = run.series(source, key)
        return [y for s, y in zip(steps, ys, strict=True) if s >= skip_steps]

    step_time = values("orchestrator", "time/step")
    tokens = values("orchestrator", "rollout/tokens_per_s") or values("orchestrator", "perf/tokens_per_s")
    staleness = values("orchestrator", "rollout/data_staleness/mean")
    reward = values("orchestrator", "reward/mean")
    kl = values("trainer", "mismatch_kl")
    return {
        "run": run.name,
        "steps": str(len(run.orchestrator)),
        "mean step time (s)": _mean(step_time, 2),
        "throughput (tok/s)": _mean(tokens, 0),
        "mean staleness": _mean(staleness, 2),
        "reward range": _range(reward, 3),
        "mismatch KL range": _range(kl, 4, scientific=True),
    }


def _mean(xs: list[float], digits: int) -> str:
    return f"{statistics.fmean(xs):.{digits}f}" if xs else "-"


def _range(xs: list[float], digits: int, *, scientific: bool = False) -> str:
    if not xs:
        return "-"
    spec = f".{digits - 2}e" if scientific else f".{digits}f"
    return f"{min(xs):{spec}} - {max(xs):{spec}}"


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean: element i is the mean of values[max(0, i - window + 1) : i + 1] (same length)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


@dataclass(frozen=True)
class TimeToReward:
    """When a run's smoothed reward first reaches `target`: None when it never does."""

    step: int | None
    seconds: float | None


def time_to_reward(run: RunMetrics, target: float, window: int) -> TimeToReward:
    """The first step (and its wall-clock end, seconds since the run's first step started) at which the
    trailing `window`-step mean of `reward/mean` is >= target. Steps are taken in increasing order."""
    steps, rewards = run.series("orchestrator", "reward/mean")
    order = sorted(range(len(steps)), key=steps.__getitem__)
    steps, rewards = [steps[i] for i in order], [rewards[i] for i in order]
    clock = run.wall_clock()
    for step, value in zip(steps, smoothed(rewards, window), strict=True):
        if value >= target:
            return TimeToReward(step=step, seconds=clock[step])
    return TimeToReward(step=None, seconds=None)


def final_smoothed_reward(run: RunMetrics, window: int) -> float:
    """The last value of the trailing `window`-step mean of `reward/mean` (the time-to-reward target)."""
    steps, rewards = run.series("orchestrator", "reward/mean")
    if not rewards:
        raise ValueError(f"{run.name}: no reward/mean in metrics/orchestrator.jsonl")
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return smoothed([rewards[i] for i in order], window)[-1]


def reference_run(runs: list[RunMetrics]) -> RunMetrics:
    """The sync run (named `sync`, K = 0) when there is one, else the first run."""
    return next((run for run in runs if run.name == "sync"), runs[0])


def time_to_reward_rows(runs: list[RunMetrics], window: int, tolerance: float = 0.0) -> list[dict[str, str]]:
    """One row per run: first/last-window reward means, time and step to the reference's final smoothed
    reward (less `tolerance`), and the time ratio to the reference ('-' where a run never reaches it)."""
    reference = reference_run(runs)
    target = final_smoothed_reward(reference, window) - tolerance
    ref_time = time_to_reward(reference, target, window).seconds
    rows = []
    for run in runs:
        _, rewards = run.series("orchestrator", "reward/mean")
        hit = time_to_reward(run, target, window)
        ratio = hit.seconds / ref_time if hit.seconds is not None and ref_time else None
        rows.append(
            {
                "run": run.name,
                f"reward first {window}": _mean(rewards[:window], 3),
                f"reward last {window}": _mean(rewards[-window:], 3),
                "target": f"{target:.3f}",
                "time to target (s)": "-" if hit.seconds is None else f"{hit.seconds:.1f}",
                "step": "-" if hit.step is None else str(hit.step),
                "ratio": "-" if ratio is None else f"{ratio:.2f}x",
            }
        )
    return rows


def print_table(rows: list[dict[str, str]]) -> None:
    headers = list(rows[0])
    widths = [max(len(h), *(len(r[h]) for r in rows)) for h in headers]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(row[h].ljust(w) for h, w in zip(headers, widths, strict=True)))


def plot(runs: list[RunMetrics], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("time per step (s)", "orchestrator", "time/step", "step"),
        ("reward vs wall-clock (s)", "orchestrator", "reward/mean", "wall"),
        ("reward vs step", "orchestrator", "reward/mean", "step"),
        ("data staleness (mean)", "orchestrator", "rollout/data_staleness/mean", "step"),
        ("mismatch KL", "trainer", "mismatch_kl", "step"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, source, key, x_kind) in zip(axes, panels, strict=True):
        for run in runs:
            steps, ys = run.series(source, key)
            xs = [run.wall_clock().get(s, float("nan")) for s in steps] if x_kind == "wall" else steps
            ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
        ax.set_title(title)
        ax.set_xlabel("wall-clock (s)" if x_kind == "wall" else "step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Compare RL runs from their metrics JSONL files.")
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("compare.png"))
    parser.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of the table")
    parser.add_argument("--window", type=int, default=5, help="steps of the trailing reward mean (>= 1)")
    parser.add_argument("--tolerance", type=float, default=0.0, help="target = reference final - this")
    args = parser.parse_args()
    if args.window < 1:
        parser.error(f"--window must be >= 1 (got {args.window})")
    try:
        runs = [load_run(d) for d in args.run_dirs]
        ttr_rows = time_to_reward_rows(runs, args.window, args.tolerance)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print_table([summarize(run, args.skip_steps) for run in runs])
    print()
    print_table(ttr_rows)
    plot(runs, args.out)


if __name__ == "__main__":
    main()
