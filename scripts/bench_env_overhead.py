"""Per-episode overhead of the verifiers environment path on CPU, by runner.

Runs real verifiers episodes of an environment (default `reverse-text`) through the real gateway against
an *instant* engine (an in-process `EngineClient` that answers at once with a fixed completion and
logprob -1.0, so that nothing but the environment path is timed: verifiers rollout, interception server,
chat-template rendering, the gateway's HTTP hop, scoring, episode assembly). Prints, per runner, the
sequential latency per episode (median and p90) and the throughput with `--concurrency` episodes in
flight.

    uv run python scripts/bench_env_overhead.py [--episodes 20] [--concurrency 8] [--cases tool/inprocess]

Cases, side by side in one run: a single-turn env (`reverse-text`) and a tool env (`calculator-tools`, a
`vf.Toolset` MCP server per episode; the engine answers the first turn with one tool call) on the
`inprocess` runner (toolset served in the orchestrator, and for comparison as verifiers' per-rollout
tool-server subprocess) and on `env_server` (verifiers' env server process over ZeroMQ + the `null`
harness program: prime-rl's path). The `null` program's first run bootstraps it with `uv sync --script`
(needs the package index or a warm uv cache); each case's first episode is a warm-up, not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from prime_async.engine_api import GenerateResult, SamplingParams


class InstantEngine:
    """Answers every `/generate` at once: `num_tokens` copies of one token id, then the stop token.
    With `tool_call_ids`, a prompt that holds no tool response yet is answered with that tool call (so a
    tool episode makes exactly one tool call, then a plain reply)."""

    def __init__(
        self, *, token_id: int, stop_id: int, num_tokens: int = 8,
        tool_call_ids: list[int] | None = None, tool_response_id: int | None = None,
    ) -> None:  # fmt: skip
        self.base_url = "instant://engine"
        self.token_id, self.stop_id, self.num_tokens = token_id, stop_id, num_tokens
        self.tool_call_ids, self.tool_response_id = tool_call_ids, tool_response_id

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None):
        ids = [self.token_id] * self.num_tokens + [self.stop_id]
        if self.tool_call_ids and self.tool_response_id not in input_ids:
            ids = [*self.tool_call_ids, self.stop_id]
        return GenerateResult(rid or "r", ids, [-1.0] * len(ids), [0] * len(ids), "stop", len(input_ids), 0)

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        return None

    async def weight_version(self) -> int:
        return 0


TOOL_CALL = (
    '<tool_call>\n{"name": "calculator_calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
)
CASES = {  # name -> (env id, runner, where task toolsets are served)
    "single-turn/inprocess": ("reverse-text", "inprocess", "inprocess"),
    "single-turn/env_server": ("reverse-text", "env_server", "verifiers"),
    "tool/inprocess": ("calculator-tools", "inprocess", "inprocess"),
    "tool/inprocess+vf-subprocess-tools": ("calculator-tools", "inprocess", "verifiers"),
    "tool/env_server": ("calculator-tools", "env_server", "verifiers"),
}


def make_engine(model_dir: str, env_id: str) -> InstantEngine:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if env_id != "calculator-tools":
        return InstantEngine(token_id=tok.encode("a")[0], stop_id=tok.eos_token_id)
    return InstantEngine(
        token_id=tok.encode("a")[0], stop_id=tok.eos_token_id,
        tool_call_ids=tok.encode(TOOL_CALL), tool_response_id=tok.convert_tokens_to_ids("<tool_response>"),
    )  # fmt: skip


async def bench_case(case: str, args: argparse.Namespace, model_dir: str) -> dict[str, float]:
    from prime_async.config.env import EnvConfig
    from prime_async.rollouts.verifiers_source import build_rollout_source

    env_id, runner, toolsets = CASES[case]
    engine = make_engine(model_dir, env_id)
    env_cfg = EnvConfig(
        id=env_id, runner=runner, toolsets=toolsets, args={"num_examples": max(64, args.episodes)}
    )
    source = build_rollout_source(env_cfg=env_cfg, engines=[engine], model_path=model_dir, seq_len=1024)
    sampling = SamplingParams(temperature=1.0, max_tokens=48)
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
        turns = statistics.mean(e.metrics.get("num_model_calls", 0) for e in episodes)
    latencies.sort()
    return {
        "median_s": statistics.median(latencies),
        "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
        "concurrent_episodes_per_s": args.episodes / wall,
        "model_calls": turns,
    }


async def _bounded(source: Any, args: argparse.Namespace, sampling: SamplingParams) -> list[Any]:
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> Any:
        async with gate:
            return await source.run_episode(example_id=i, engine_key=str(i), sampling=sampling)

    return await asyncio.gather(*(one(i) for i in range(args.episodes)))


def fresh_renderers_lock() -> None:
    """`renderers.client` keeps a module-level asyncio.Lock bound to the first event loop that contends
    it; each case runs its own loop here (a real process runs one), so give each case a fresh lock."""
    import sys

    module = sys.modules.get("renderers.client")
    if module is not None and hasattr(module, "_max_prompt_len_lock"):
        module._max_prompt_len_lock = asyncio.Lock()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()

    import torch

    from prime_async.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp))
        t0 = time.perf_counter()
        import verifiers.v1  # noqa: F401  (timed separately: it is a one-time cost per process)

        print(f"import verifiers.v1: {time.perf_counter() - t0:.1f} s (once per process)")
        for case in args.cases:
            fresh_renderers_lock()
            r = asyncio.run(bench_case(case, args, model_dir))
            print(
                f"{case:<36} sequential: median {r['median_s'] * 1e3:7.1f} ms/episode, "
                f"p90 {r['p90_s'] * 1e3:7.1f} ms | concurrency {args.concurrency}: "
                f"{r['concurrent_episodes_per_s']:6.1f} episodes/s | "
                f"{r['model_calls']:.1f} model calls/episode",
                flush=True,
            )


if __name__ == "__main__":
    main()
