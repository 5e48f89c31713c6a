"""Per-episode overhead of the verifiers environment path on CPU, by runner.

Runs real verifiers episodes of an environment (default `reverse-text`) through the real gateway against
an *instant* engine (an in-process `EngineClient` that answers at once with a fixed completion and
logprob -1.0, so that nothing but the environment path is timed: verifiers rollout, interception server,
chat-template rendering, the gateway's HTTP hop, scoring, episode assembly). Prints, per runner, the
sequential latency per episode (median and p90) and the throughput with `--concurrency` episodes in
flight.

    uv run python scripts/bench_env_overhead.py [--episodes 20] [--concurrency 8] [--runners inprocess]

Runners (`env.runner`): `inprocess` (the default: in-process chat harness), `subprocess` (verifiers'
`null` harness program per episode), `env_server` (verifiers' env server process over ZeroMQ + the `null`
harness program: prime-rl's path). The `null` program's first run bootstraps it with `uv sync --script`
(needs the package index or a warm uv cache); each runner's first episode is a warm-up, not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from prime_async.inference.types import GenerateResult


class InstantEngine:
    """Answers every `/generate` at once: `num_tokens` copies of one token id, then the stop token."""

    def __init__(self, *, token_id: int, stop_id: int, num_tokens: int = 8) -> None:
        self.base_url = "instant://engine"
        self.token_id, self.stop_id, self.num_tokens = token_id, stop_id, num_tokens

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None):
        ids = [self.token_id] * self.num_tokens + [self.stop_id]
        return GenerateResult(rid or "r", ids, [-1.0] * len(ids), [0] * len(ids), "stop", len(input_ids), 0)

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        return None

    async def weight_version(self) -> int:
        return 0


async def bench_runner(runner: str, args: argparse.Namespace, model_dir: str) -> dict[str, float]:
    from transformers import AutoTokenizer

    from prime_async.config.env import EnvConfig
    from prime_async.orchestrator.envs import build_rollout_source

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = InstantEngine(token_id=tok.encode("a")[0], stop_id=tok.eos_token_id)
    env_cfg = EnvConfig(id=args.env, runner=runner, args={"num_examples": max(64, args.episodes)})
    source = build_rollout_source(env_cfg=env_cfg, engines=[engine], model_path=model_dir, seq_len=1024)
    sampling = {"temperature": 1.0, "max_tokens": 16}
    async with source:
        await source.run_episode(example_id=0, engine_key="0", sampling=sampling)  # warm-up / bootstrap
        latencies = []
        for i in range(args.episodes):
            t0 = time.perf_counter()
            ep = await source.run_episode(example_id=i, engine_key="0", sampling=sampling)
            latencies.append(time.perf_counter() - t0)
            assert ep.status == "ok", ep.error
        t0 = time.perf_counter()
        episodes = await _bounded(source, args, sampling)
        wall = time.perf_counter() - t0
        assert all(e.status == "ok" for e in episodes), [e.error for e in episodes if e.status != "ok"]
    latencies.sort()
    return {
        "median_s": statistics.median(latencies),
        "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
        "concurrent_episodes_per_s": args.episodes / wall,
    }


async def _bounded(source: Any, args: argparse.Namespace, sampling: dict[str, Any]) -> list[Any]:
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> Any:
        async with gate:
            return await source.run_episode(example_id=i, engine_key=str(i), sampling=sampling)

    return await asyncio.gather(*(one(i) for i in range(args.episodes)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default="reverse-text")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runners", nargs="+", default=["inprocess", "subprocess", "env_server"])
    args = parser.parse_args()

    import torch

    from prime_async.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp))
        t0 = time.perf_counter()
        import verifiers.v1  # noqa: F401  (timed separately: it is a one-time cost per process)

        print(f"import verifiers.v1: {time.perf_counter() - t0:.1f} s (once per process)")
        for runner in args.runners:
            r = asyncio.run(bench_runner(runner, args, model_dir))
            print(
                f"{args.env} runner={runner:<10} sequential: median {r['median_s'] * 1e3:7.1f} ms/episode, "
                f"p90 {r['p90_s'] * 1e3:7.1f} ms | concurrency {args.concurrency}: "
                f"{r['concurrent_episodes_per_s']:6.1f} episodes/s"
            )


if __name__ == "__main__":
    main()
