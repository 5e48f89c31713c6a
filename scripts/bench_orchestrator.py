"""Orchestrator overhead per episode against the simulated engine.

The simulation runs on a virtual clock and is measured in process CPU time, so neither simulated latency
nor other load on the machine inflates the figure.

    uv run python scripts/bench_orchestrator.py [--episodes 10000] [--group-size 8] [--batch-groups 16]

Runs the real components (dispatcher, admission, sink, group table checks, batching, weight watcher) with
simulated engines and a fake trainer on a virtual clock, then runs the same number of simulated episodes
without the orchestrator (a plain worker pool of the same concurrency over the rollout source). The
difference divided by the number of dispatched episodes is the orchestrator's overhead per episode
(target < 1 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import SamplingParams
from prime_async.simulation import (
    SimParams,
    SimulatedEngine,
    SimulatedRolloutSource,
    run_simulation,
    run_virtual,
)


async def _bare_episodes(params: SimParams, num_episodes: int, concurrency: int) -> None:
    """The same simulated episodes with the same concurrency, scheduled by a plain worker pool."""
    rng = random.Random(params.seed)
    engines = [SimulatedEngine(index=i, params=params, rng=rng) for i in range(params.num_engines)]
    source = SimulatedRolloutSource(engines=engines, params=params, rng=rng)
    todo = iter(range(num_episodes))

    async def worker() -> None:
        for i in todo:
            await source.run_episode(example_id=i, engine_key=f"g{i}-e0", sampling=SamplingParams())

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=16)
    parser.add_argument("--k", type=int, default=2)
    args = parser.parse_args()
    steps = math.ceil(args.episodes / (args.group_size * args.batch_groups))
    cfg = OrchestratorConfig(
        max_steps=steps, batch_groups=args.batch_groups, group_size=args.group_size,
        max_off_policy_steps=args.k, inference={"max_running_requests": 64, "base_urls": ["a", "b"]},
        wandb={"enabled": False},
    )  # fmt: skip
    params = SimParams(seed=0, num_examples=1000, latency_s=1.0, pareto_alpha=1.5, train_time_s=2.0)

    t0 = time.process_time()
    result = run_virtual(run_simulation(cfg, params, instrument=False))
    t_orch = time.process_time() - t0
    dispatched = result.comps.groups.dispatched
    trained = result.comps.groups.counts()["trained"]

    t0 = time.process_time()
    run_virtual(_bare_episodes(params, dispatched, cfg.resolved_max_inflight_groups * cfg.group_size))
    t_bare = time.process_time() - t0

    overhead_ms = (t_orch - t_bare) / dispatched * 1e3
    print(f"steps {steps}, episodes dispatched {dispatched}, trained {trained}")
    print(f"simulated time {result.elapsed_s:.0f} s")
    print(f"orchestrator + simulated engine: {t_orch:.2f} s CPU ({t_orch / dispatched * 1e3:.3f} ms/episode)")
    print(f"simulated engine alone:          {t_bare:.2f} s CPU ({t_bare / dispatched * 1e3:.3f} ms/episode)")
    print(f"orchestrator overhead per episode: {overhead_ms:.3f} ms (target < 1 ms)")


if __name__ == "__main__":
    main()
