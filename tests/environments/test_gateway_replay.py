"""Replay of recorded calls after an orchestrator restart (`rollouts/replay.py`), over real HTTP with the
tiny model run by HF in-process: a finished call is answered from its record without an engine call, a
partial one is continued by the engine after its kept tokens, a prompt without a record is generated."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from hf_engine import HFEngineClient

from prime_async.rollouts.gateway import GENERATE_ROUTE, Gateway, GatewayCall


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngineClient:
    return HFEngineClient(model_dir=str(tiny_model_dir), base_url="hf://a", version=5)


def _body(key: str, token_ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
    params = {"temperature": 1.0, "max_tokens": max_tokens, "logprobs": 1}
    return {"model": key, "token_ids": token_ids, "sampling_params": params}


async def _post(gw: Gateway, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{gw.base_url}{GENERATE_ROUTE}", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _call(prompt: list[int], out: list[int], finish: str, version: int = 2) -> GatewayCall:
    return GatewayCall(
        prompt_ids=prompt, output_ids=out, output_logprobs=[-0.5] * len(out),
        token_versions=[version] * len(out), finish_type=finish, weight_version=version,
    )  # fmt: skip


def test_recorded_turns_are_replayed_and_a_cut_turn_continued(engine: HFEngineClient) -> None:
    async def main() -> None:
        first, second = [5, 6, 7], [5, 6, 7, 40, 41, 9, 9]
        record = [_call(first, [40, 41], "stop"), _call(second, [50, 51, 52], "abort")]
        async with Gateway(engines=[engine], seq_len=256) as gw:
            session = gw.open_session(engine_key="g0-e0", replay=record)
            before = len(engine.requests)
            turn1 = await _post(gw, _body(session.key, first))
            assert turn1["token_ids"] == [40, 41] and turn1["finish_reason"] == "stop"
            assert len(engine.requests) == before, "a finished recorded call must not reach the engine"
            other = await _post(gw, _body(session.key, [1, 2, 3]))  # no record: generated afresh
            assert engine.requests[-1]["input_ids"] == [1, 2, 3] and other["token_ids"]
            turn2 = await _post(gw, _body(session.key, second, max_tokens=8))
            sent = engine.requests[-1]
            assert sent["input_ids"] == [*second, 50, 51, 52], "the kept tokens are re-prefilled"
            assert sent["sampling_params"]["max_new_tokens"] == 8 - 3, "the budget counts the kept tokens"
            assert turn2["token_ids"][:3] == [50, 51, 52] and len(turn2["token_ids"]) > 3
            assert [c["logprob"] for c in turn2["logprobs"]["content"][:3]] == [-0.5] * 3
            whole = session.calls[-1]
            assert whole.prompt_ids == second and whole.token_versions[:3] == [2, 2, 2]
            assert set(whole.token_versions[3:]) == {5}, "new tokens carry the version served now"
            stats = gw.replay_stats
            assert (stats.replayed_calls, stats.replayed_tokens) == (1, 2)
            assert (stats.continued_calls, stats.continued_tokens, stats.misses) == (1, 3, 1)

    asyncio.run(main())


def test_a_replayed_call_that_filled_seq_len_marks_the_episode_truncated(engine: HFEngineClient) -> None:
    """Replay must not lose what a call's end said when it was sampled: a `length` finish that filled
    `seq_len` makes the episode overlong (audit 2026-12-04, F5), a shorter `length` finish does not."""

    async def main() -> None:
        prompt = [5, 6, 7, 8, 9]
        async with Gateway(engines=[engine], seq_len=8) as gw:
            before = len(engine.requests)
            filled = gw.open_session(engine_key="g0-e0", replay=[_call(prompt, [40, 41, 42], "length")])
            await _post(gw, _body(filled.key, prompt, max_tokens=10))
            short = gw.open_session(engine_key="g0-e1", replay=[_call(prompt, [40], "length")])
            await _post(gw, _body(short.key, prompt, max_tokens=1))
            # a partial call cut exactly when its budget was used up: finished as `length` from the record
            cut = gw.open_session(engine_key="g0-e2", replay=[_call(prompt, [40, 41, 42], "abort")])
            await _post(gw, _body(cut.key, prompt, max_tokens=10))
            assert len(engine.requests) == before, "every call was answered from the record"
        assert filled.truncated and cut.truncated, (filled.calls, cut.calls)
        assert not short.truncated and not (filled.aborted or short.aborted or cut.aborted)

    asyncio.run(main())
