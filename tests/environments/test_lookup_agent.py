"""The agentic benchmark environment: seeded data and latencies, its reward, and real episodes (tiny model
through the gateway): one tool call and one model turn per lookup, the tool reached over MCP."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from hf_engine import HFEngineClient

from prime_async.config.env import EnvConfig
from prime_async.engine_api import SamplingParams
from prime_async.rollouts.verifiers_source import build_rollout_source

pytest.importorskip("verifiers.v1")


def test_data_lookups_and_latencies_are_seeded_and_heavy_tailed() -> None:
    from lookup_agent import call_latency, lookups_per_task, make_corpus

    assert make_corpus(50, 3) == make_corpus(50, 3) != make_corpus(50, 4)
    rng = random.Random("tasks:0")
    counts = [lookups_per_task(rng, min_calls=1, max_calls=8, alpha=1.2) for _ in range(4000)]
    assert min(counts) == 1 and max(counts) == 8
    assert statistics.median(counts) == 1 and counts.count(8) > 40  # most need one, a long tail needs many
    latencies = sorted(call_latency(0, f"t{i}", 0, median_s=0.4, sigma=1.0, max_s=10.0) for i in range(4000))
    p50, p99 = latencies[2000], latencies[3960]
    assert 0.35 < p50 < 0.45 and p99 > 6 * p50 and latencies[-1] <= 10.0
    assert call_latency(0, "t1", 2, median_s=0.4, sigma=1.0, max_s=10) == call_latency(
        0, "t1", 2, median_s=0.4, sigma=1.0, max_s=10
    )


def test_reward_scores_each_reply_against_its_code() -> None:
    from lookup_agent import similarity

    assert similarity(" cedar lagoon 41 ", "cedar lagoon 41") == 1.0
    assert 0.0 < similarity("The code is cedar lagoon 41.", "cedar lagoon 41") < 1.0


def test_episodes_call_the_tool_once_per_lookup_and_answer_each_result(tiny_model_dir: Path) -> None:
    engine = HFEngineClient(model_dir=str(tiny_model_dir), version=3)
    env_cfg = EnvConfig(
        id="lookup-agent", args={"num_examples": 8, "seed": 0, "max_calls": 3, "calls_alpha": 0.7},
        config={"latency_median_s": 0.2, "latency_sigma": 0.5, "latency_max_s": 1.0},
    )  # fmt: skip

    async def main() -> list[Any]:
        async with build_rollout_source(env_cfg=env_cfg, engines=[engine], model_path=str(tiny_model_dir),
                                        seq_len=1024) as source:  # fmt: skip
            t0 = time.perf_counter()
            sampling = SamplingParams(temperature=1.0, max_tokens=8)
            episodes = await asyncio.gather(
                *(source.run_episode(example_id=i, engine_key=str(i), sampling=sampling) for i in range(4))
            )
            return [episodes, [source._tasks[i] for i in range(4)], time.perf_counter() - t0]

    episodes, tasks, wall = asyncio.run(main())
    for ep, task in zip(episodes, tasks, strict=True):
        assert ep.status == "ok", ep.error
        calls = len(task.data.records)
        assert ep.metrics["num_turns"] == calls and ep.metrics["num_model_calls"] == calls
        assert 0.0 <= ep.reward <= 1.0 and ep.metrics["episode_seconds"] > 0
        assert sum(ep.loss_mask) > 0 and not ep.loss_mask[0]
    assert max(len(t.data.records) for t in tasks) > 1  # a multi-turn episode was among them
    assert wall < sum(ep.metrics["episode_seconds"] for ep in episodes)  # episodes overlapped (tool waits)
