"""The embedded engine with `deterministic = true` is batch-invariant: a seeded request's tokens and
logprobs are bit-identical whether it runs alone or among other requests, admitted before or after them
(real engine thread, real tiny model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prime_async.inference.engine import Engine, RequestOutput
from prime_async.inference.engine_settings import EngineSettings, SlotSettings
from prime_async.inference.sampler import SamplingParams


def _params(seed: int, n: int = 12) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=seed)


async def _runs(model_dir: Path) -> tuple[RequestOutput, list[RequestOutput], list[RequestOutput], int]:
    slots = SlotSettings(max_running_requests=8, max_len=128, kv_cache_chunk=16)
    engine = Engine(EngineSettings(model_path=str(model_dir), dtype="float32", device="cpu",
                                   deterministic=True, slots=slots))  # fmt: skip
    engine.start()
    try:
        prompt = [5, 9, 13, 17, 21]
        alone = await engine.generate(prompt, _params(123))
        others = [([7 + i] * (3 + 4 * i), _params(i, n=5 + 3 * i)) for i in range(5)]
        most_running = 0

        async def watch() -> None:
            nonlocal most_running
            while True:
                most_running = max(most_running, engine.stats()["num_running_reqs"])
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        first = await asyncio.gather(
            engine.generate(prompt, _params(123)), *(engine.generate(p, s) for p, s in others)
        )  # the request first in the queue ...
        last = await asyncio.gather(
            *(engine.generate(p, s) for p, s in others), engine.generate(prompt, _params(123))
        )  # ... and last, behind requests of other lengths
        watcher.cancel()
        other_seed = await engine.generate(prompt, _params(124))
        assert other_seed.output_ids != alone.output_ids  # the seed, not the prompt, drives sampling
        return alone, first, last, most_running
    finally:
        engine.stop()


def test_seeded_request_is_identical_alone_and_in_a_crowd(tiny_model_dir: Path) -> None:
    alone, first, last, most_running = asyncio.run(_runs(tiny_model_dir))
    assert most_running == 1  # one request at a time
    assert len(alone.output_ids) == 12
    for crowded in (first[0], last[-1]):
        assert crowded.output_ids == alone.output_ids
        assert crowded.logprobs == alone.logprobs  # bit-identical floats, not approximately equal
    assert [r.output_ids for r in first[1:]] == [r.output_ids for r in last[:-1]]
