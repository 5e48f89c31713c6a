"""The agentic benchmark: one config, sync (K = 0) against async (K = 1, 2, 4), side by side in one run.

Usage:
    uv run python scripts/bench_agentic.py                       # configs/lookup_agent/rl.toml, K = 0 1 2 4
    uv run python scripts/bench_agentic.py --ks 0 2 --steps 12 --out-dir outputs/bench_agentic [rl overrides]
    uv run python scripts/bench_agentic.py --sglang              # engines on real SGLang (CPU)
    uv run python scripts/bench_agentic.py --report-only         # the tables again, from the last runs

Each K runs `rl` to completion on the same config with `--orchestrator.max-off-policy-steps K` only (the
admission buffer follows K by default: `admission.max_buffered_groups = (K + 1) * batch_groups`,
groups in flight plus finished-untrained; admission's landing rule admits fewer when the orchestrator is
ahead; pass `--orchestrator.admission.max-buffered-groups N` to pin it). Printed:

  episodes     the length distribution of every finished episode of every run (`metrics/episodes.jsonl`):
               turns, tokens (prompt + completion), wall seconds, at p50 / p90 / p99 / max
  per K        step (s): mean orchestrator step time after step 0; speed-up: sync step / this step;
               engine busy: mean `engine/busy_fraction` (share of wall time the engine spent in forward
               steps); trainer idle: waiting-for-batch time / trainer wall time; staleness: share of
               trained groups at staleness 0, 1, ...; dropped: trajectories dropped as stale; cancelled:
               cancelled / dispatched trajectories (`ledger/*`); prompts lost: prompts issued and never
               trained (`ledger/prompts_lost`); length bias: the run's last `rollout/length_bias`;
               reward first/last:
               mean of the first / last `--window` steps (+- the standard error of the last window)
  time to reward  two robust definitions, each as a ratio to the sync run (< 1: async is faster):
               gain90: wall time until the run's smoothed reward (trailing `--window` mean) first reaches
                       the sync run's first-window reward + 90% of the sync run's gain;
               auc:    the mean reward over [0, T], T = the shortest run's wall time (reward per second of
                       the same time budget; a ratio > 1 is better)
  reward curve  each run's per-step reward, for the curves to be compared by eye

Exits 1 when a run fails. The figures of one call are noisy (one seed, a shared 2-core machine): the
speed-up is a ratio of means over steps of the same call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import run_rl
from compare_runs import RunMetrics, load_run, smoothed

ROOT = Path(__file__).resolve().parents[1]
SGLANG_FLAGS = ["@", str(ROOT / "configs/tiny/rl_sglang_cpu.toml")]  # the slow tests' SGLang-on-CPU flags


@dataclass
class KResult:
    k: int
    run: RunMetrics
    episodes: list[dict]
    step_s: float
    engine_busy: float | None
    trainer_idle: float
    staleness: dict[int, float]
    dropped: float
    cancelled_share: float
    prompts_lost: float
    length_bias: float | None
    wall_s: float


def quantiles(values: list[float]) -> tuple[float, float, float, float]:
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)]

    return q(0.5), q(0.9), q(0.99), ordered[-1]


def read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def summarize(k: int, run_dir: Path) -> KResult:
    run = load_run(run_dir)
    orch = [r for r in run.orchestrator if r["step"] >= 1]
    busy = [r["engine/busy_fraction"] for r in orch if "engine/busy_fraction" in r]
    trainer = [r for r in run.trainer if r["step"] >= 1]
    waited = sum(r["time/wait_for_batch"] for r in trainer)
    worked = sum(r["time/train"] + r["time/publish_weights"] for r in trainer)
    groups: dict[int, float] = {}
    for r in run.orchestrator:
        for key, value in r.items():
            if key.startswith("rollout/data_staleness/ratio_"):
                s = int(key.rsplit("_", 1)[1])
                groups[s] = groups.get(s, 0.0) + value * r["rollout/trained_groups"]
    total = sum(groups.values()) or 1.0
    clock = run.wall_clock()
    last = max(run.orchestrator, key=lambda r: r["step"])
    return KResult(
        k=k, run=run, episodes=read_jsonl(run_dir / "metrics" / "episodes.jsonl"),
        step_s=statistics.fmean(r["time/step"] for r in orch),
        engine_busy=statistics.fmean(busy) if busy else None,
        trainer_idle=waited / max(waited + worked, 1e-9),
        staleness={s: n / total for s, n in sorted(groups.items())},
        dropped=last.get("ledger/dropped_stale", 0.0),
        cancelled_share=last.get("ledger/cancelled", 0.0) / max(last.get("ledger/dispatched", 0.0), 1.0),
        prompts_lost=last.get("ledger/prompts_lost", 0.0),
        length_bias=last.get("rollout/length_bias"),
        wall_s=max(clock.values()),
    )  # fmt: skip


def rewards(run: RunMetrics) -> tuple[list[float], list[float]]:
    """(wall-clock end of each step, reward/mean of each step), in step order."""
    clock = run.wall_clock()
    steps, values = run.series("orchestrator", "reward/mean")
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [clock[steps[i]] for i in order], [values[i] for i in order]


def time_to_gain(run: RunMetrics, target: float, window: int) -> float | None:
    times, values = rewards(run)
    return next((t for t, v in zip(times, smoothed(values, window), strict=True) if v >= target), None)


def reward_auc(run: RunMetrics, horizon: float) -> float:
    """Mean of the step-wise reward curve over [0, horizon] (each step's reward holds from its end on; the
    time before the first step counts as that step's reward)."""
    times, values = rewards(run)
    area, last_t, last_v = 0.0, 0.0, values[0]
    for t, v in zip(times, values, strict=True):
        if t >= horizon:
            break
        area += (t - last_t) * last_v
        last_t, last_v = t, v
    return (area + (horizon - last_t) * last_v) / horizon


def print_episodes(results: list[KResult]) -> None:
    episodes = [e for r in results for e in r.episodes if e.get("status") == "ok"]
    print(f"\nepisode lengths ({len(episodes)} episodes of {len(results)} runs)")
    print("| measure | p50 | p90 | p99 | max |\n|---|---|---|---|---|")
    for key, fmt in (("turns", "{:.0f}"), ("tokens", "{:.0f}"), ("seconds", "{:.2f}")):
        values = [float(e[key]) for e in episodes if e.get(key) is not None]
        if values:
            print(f"| {key} | " + " | ".join(fmt.format(v) for v in quantiles(values)) + " |")


def print_table(results: list[KResult], window: int) -> None:
    sync = next((r for r in results if r.k == 0), results[0])
    _, sync_rewards = rewards(sync.run)
    start = statistics.fmean(sync_rewards[:window])
    gain = smoothed(sync_rewards, window)[-1] - start
    target = start + 0.9 * gain
    sync_hit = time_to_gain(sync.run, target, window)
    horizon = min(r.wall_s for r in results)
    sync_auc = reward_auc(sync.run, horizon)
    print(f"\ntime to reward: gain90 target {target:.3f} (sync first {window} {start:.3f} + 0.9 x gain "
          f"{gain:.3f}); auc over the first {horizon:.0f} s")  # fmt: skip
    print("| K | step (s) | speed-up | engine busy | trainer idle | staleness 0/1/2/.. | dropped | cancelled "
          "| prompts lost | length bias | reward first | reward last | gain90 (s) | gain90 ratio | auc "
          "| auc ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        _, values = rewards(r.run)
        last = values[-window:]
        err = statistics.stdev(last) / math.sqrt(len(last)) if len(last) > 1 else 0.0
        hit, auc = time_to_gain(r.run, target, window), reward_auc(r.run, horizon)
        cells = [
            str(r.k), f"{r.step_s:.2f}", f"{sync.step_s / r.step_s:.2f}x",
            "-" if r.engine_busy is None else f"{r.engine_busy:.2f}", f"{r.trainer_idle:.2f}",
            "/".join(f"{r.staleness.get(s, 0.0):.2f}" for s in range(max(r.staleness, default=0) + 1)),
            f"{r.dropped:.0f}", f"{r.cancelled_share:.1%}", f"{r.prompts_lost:.0f}",
            "-" if r.length_bias is None else f"{r.length_bias:.2f}",
            f"{statistics.fmean(values[:window]):.3f}",
            f"{statistics.fmean(last):.3f} +- {err:.3f}",
            "-" if hit is None else f"{hit:.0f}",
            "-" if hit is None or not sync_hit else f"{hit / sync_hit:.2f}x",
            f"{auc:.3f}", f"{auc / sync_auc:.2f}x" if sync_auc else "-",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print("\nreward curves (per step)")
    for r in results:
        _, values = rewards(r.run)
        print(f"K = {r.k}: " + " ".join(f"{v:.2f}" for v in values))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs/lookup_agent/rl.toml")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: the config's)")
    parser.add_argument("--window", type=int, default=4, help="steps of the reward windows and smoothing")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "outputs/bench_agentic")
    parser.add_argument("--sglang", action="store_true", help="engines on real SGLang (CPU)")
    parser.add_argument("--report-only", action="store_true", help="only the tables, from --out-dir's runs")
    args, extra = parser.parse_known_args()
    results = []
    for k in args.ks:
        run_dir = args.out_dir / f"k{k}"
        if not args.report_only:
            flags = ["--wandb.name", f"k{k}", *(SGLANG_FLAGS if args.sglang else [])]
            run_rl(args.config, run_dir, args.steps, k, [*flags, *extra])
        results.append(summarize(k, run_dir))
    print_episodes(results)
    print_table(results, args.window)


if __name__ == "__main__":
    main()
