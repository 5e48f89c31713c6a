"""Admission and cut rule in the scheduling simulator: what is generated, what ships, and the step time.

Usage:
    uv run python scripts/bench_admission.py                      # K = 0 1 2 4 8, both regimes, seeds 0-2
    uv run python scripts/bench_admission.py --ks 1 2 --seeds 0 --steps 60

Runs the project's real admission, dispatcher, group table, sink and weight watcher on the simulator's
virtual clock (`prime_async.simulation`; engines and trainer simulated) in two regimes:

  trainer-bound     episodes take ~0.05 s (Pareto, cut at 1 s), a train step 2 s
  generation-bound  episodes take ~1 s (Pareto alpha 1.5, cut at 30 s), a train step 0.1 s; engines run
                    any number of requests at once, so a cancelled request costs nobody anything
  gen-bound, 4 slots  the same, each engine running 4 requests at once (more queue), as a real engine
                    whose capacity is used up: cancelled work takes capacity from the work that ships

and prints, per K and regime (sums over the seeds): dispatched groups, cancelled / dispatched, dropped
stale / dispatched, prompts issued but never trained outside the work still in flight at the end, the
mean step time after step 3, and the share of trained groups at each staleness. The default config is
used throughout (`max_buffered_groups = (K + 1) * batch_groups`, `unused_handler = "drop"`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.simulation import SimParams, SimulationResult, run_simulation, run_virtual

REGIMES = {
    "trainer-bound": {"latency_s": 0.05, "train_time_s": 2.0, "max_latency_s": 1.0},
    "generation-bound": {"latency_s": 1.0, "train_time_s": 0.1, "max_latency_s": 30.0},
    "gen-bound, 4 slots": {"latency_s": 1.0, "train_time_s": 0.1, "max_latency_s": 30.0, "engine_slots": 4},
}


@dataclass
class Row:
    dispatched: int = 0
    cancelled: int = 0
    stale: int = 0
    never_trained: int = 0
    issued: int = 0
    step_s: list[float] | None = None
    staleness: dict[int, int] | None = None


def simulate(k: int, regime: str, seed: int, steps: int) -> SimulationResult:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = OrchestratorConfig.model_validate({
            "output_dir": tmp, "max_steps": steps, "batch_groups": 4, "group_size": 2,
            "max_off_policy_steps": k, "inference": {"base_urls": ["sim://engine0", "sim://engine1"]},
            "admission": {"max_dropped_groups_per_step": 100000}, "wandb": {"enabled": False},
        })  # fmt: skip
        params = SimParams(num_engines=2, num_examples=100000, seed=seed, **REGIMES[regime])
        return run_virtual(run_simulation(cfg, params))


def accumulate(row: Row, res: SimulationResult) -> None:
    groups = res.comps.groups
    counts = groups.counts()
    row.dispatched += groups.dispatched // groups.group_size
    row.cancelled += counts["cancelled"] // groups.group_size
    row.stale += counts["dropped_stale"] // groups.group_size
    issued = set(res.source.started)
    trained = {g.example_id for gs in res.trained.values() for g in gs}
    pending = {g.example_id for g in groups.pending_groups()}
    row.issued += len(issued)
    row.never_trained += len(issued - trained - pending)
    times = [m["time/step"] for s, m in res.metrics.items() if s >= 3]
    row.step_s = (row.step_s or []) + times
    row.staleness = row.staleness or {}
    for step, batch in res.trained.items():
        for g in batch:
            row.staleness[step - g.dispatch_version] = row.staleness.get(step - g.dispatch_version, 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(
        "| K | regime | dispatched | cancelled | dropped stale | never trained (of issued) | step (s) "
        "| staleness 0/1/.. |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k in args.ks:
        for regime in REGIMES:
            row = Row()
            for seed in args.seeds:
                accumulate(row, simulate(k, regime, seed, args.steps))
            total = sum(row.staleness.values())
            ages = "/".join(f"{row.staleness.get(a, 0) / total:.2f}" for a in range(max(row.staleness) + 1))
            print(f"| {k} | {regime} | {row.dispatched} | {row.cancelled / row.dispatched:.1%} | "
                  f"{row.stale / row.dispatched:.1%} | {row.never_trained} of {row.issued} | "
                  f"{statistics.mean(row.step_s):.3f} | {ages} |")  # fmt: skip


if __name__ == "__main__":
    main()
