"""The token gateway over real HTTP: vLLM-shaped answers, sticky routing, seq_len clamping, per-episode
records, refusal of unknown/cancelled episodes, and engine aborts on cancel. The engines are the tiny
model run by HF in-process (`hf_engine.py`): real weights and real logprobs."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from hf_engine import HFEngineClient

from prime_async.engine_api import SamplingParams
from prime_async.rollouts.gateway import GENERATE_ROUTE, Gateway
from prime_async.rollouts.seeds import call_seed


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> list[HFEngineClient]:
    return [
        HFEngineClient(model_dir=str(tiny_model_dir), base_url="hf://a", version=3),
        HFEngineClient(model_dir=str(tiny_model_dir), base_url="hf://b", version=3),
    ]


def _body(key: str, token_ids: list[int], **sampling: Any) -> dict[str, Any]:
    params = {"temperature": 1.0, "max_tokens": 8, "logprobs": 1, "skip_special_tokens": False, **sampling}
    return {"model": key, "token_ids": token_ids, "sampling_params": params}


async def _post(gw: Gateway, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{gw.base_url}{GENERATE_ROUTE}", json=body)


def test_generate_shape_and_records(engines: list[HFEngineClient]) -> None:
    async def main() -> None:
        async with Gateway(engines=engines[:1], seq_len=256) as gw:
            session = gw.open_session(engine_key="any", sampling=SamplingParams(temperature=0.7))
            prompt = [5, 6, 7, 8]
            r = await _post(gw, _body(session.key, prompt, max_tokens=6, stop_token_ids=[2]))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            ids = choice["token_ids"]
            assert 1 <= len(ids) <= 6
            assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
            assert all(
                math.isfinite(c["logprob"]) and c["logprob"] <= 0 for c in choice["logprobs"]["content"]
            )
            assert choice["finish_reason"] in ("stop", "length")
            sent = engines[0].requests[-1]
            assert sent["input_ids"] == prompt
            # vLLM names -> SGLang names; the episode's sampling overrides the request's.
            assert sent["sampling_params"]["max_new_tokens"] == 6
            assert sent["sampling_params"]["stop_token_ids"] == [2]
            assert sent["sampling_params"]["temperature"] == 0.7
            assert "logprobs" not in sent["sampling_params"] and "max_tokens" not in sent["sampling_params"]
            (call,) = session.calls
            assert call.prompt_ids == prompt and call.output_ids == ids
            assert call.token_versions == [3] * len(ids)
            assert [round(x, 5) for x in call.output_logprobs] == [
                round(c["logprob"], 5) for c in choice["logprobs"]["content"]
            ]
            async with httpx.AsyncClient() as client:
                models = (await client.get(f"{gw.base_url}/v1/models")).json()
            assert {"id": session.key, "max_model_len": 256} in models["data"]

    asyncio.run(main())


def test_sticky_routing_per_episode(engines: list[HFEngineClient]) -> None:
    async def main() -> None:
        async with Gateway(engines=engines, seq_len=256) as gw:
            assert gw.engine_for("hf://b") == 1 and gw.engine_for("0") == 0
            sessions = [gw.open_session(engine_key=f"g{g}-e{i}") for g in range(4) for i in range(2)]
            before = [len(e.requests) for e in engines]
            for turn in range(3):
                await asyncio.gather(*(_post(gw, _body(s.key, [5, 6, turn], max_tokens=2)) for s in sessions))
            for s in sessions:
                assert len(s.calls) == 3
            per_engine = [len(e.requests) - b for e, b in zip(engines, before, strict=True)]
            expected = [3 * sum(1 for s in sessions if s.engine_index == i) for i in range(2)]
            assert per_engine == expected
            assert all(e.requests[-1]["input_ids"][:2] == [5, 6] for e in engines if len(e.requests))

    asyncio.run(main())


def test_seq_len_clamp_and_truncation(engines: list[HFEngineClient]) -> None:
    async def main() -> None:
        async with Gateway(engines=engines[:1], seq_len=20) as gw:
            session = gw.open_session(engine_key="0")
            r = await _post(gw, _body(session.key, list(range(5, 20)), max_tokens=100))
            assert r.status_code == 200
            assert engines[0].requests[-1]["sampling_params"]["max_new_tokens"] == 5
            assert len(r.json()["choices"][0]["token_ids"]) <= 5
            n_requests = len(engines[0].requests)
            full = await _post(gw, _body(session.key, list(range(5, 25)), max_tokens=100))
            choice = full.json()["choices"][0]
            assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
            assert session.truncated and len(engines[0].requests) == n_requests  # engine not called

    asyncio.run(main())


def test_unknown_and_cancelled_episodes_are_refused(engines: list[HFEngineClient]) -> None:
    async def main() -> None:
        async with Gateway(engines=engines[:1], seq_len=64) as gw:
            assert (await _post(gw, _body("nobody", [5, 6]))).status_code == 404
            session = gw.open_session(engine_key="0")
            assert (await _post(gw, {"model": session.key, "token_ids": "x"})).status_code == 400
            await gw.cancel_session(session.key)
            assert (await _post(gw, _body(session.key, [5, 6]))).status_code == 409

    asyncio.run(main())


def test_cancel_aborts_inflight_engine_request(engines: list[HFEngineClient]) -> None:
    engine = engines[0]

    async def main() -> None:
        async with Gateway(engines=[engine], seq_len=4096) as gw:
            session = gw.open_session(engine_key="0")
            pending = asyncio.create_task(_post(gw, _body(session.key, [5, 6, 7], max_tokens=4000)))
            deadline = asyncio.get_running_loop().time() + 60
            while not session.inflight:
                assert asyncio.get_running_loop().time() < deadline, "request never reached the engine"
                await asyncio.sleep(0.01)
            await gw.cancel_session(session.key)
            r = await pending
            assert r.json()["choices"][0]["finish_reason"] == "abort"
            assert session.aborted
            assert len(r.json()["choices"][0]["token_ids"]) < 4000

    asyncio.run(main())


def test_session_keys_are_recycled_after_quarantine(engines: list[HFEngineClient]) -> None:
    from prime_async.rollouts.gateway import KEY_QUARANTINE

    gw = Gateway(engines=engines[:1], seq_len=64)
    seen: list[str] = []
    for _ in range(3 * KEY_QUARANTINE):
        session = gw.open_session(engine_key="0")
        assert session.key not in gw.sessions or gw.sessions[session.key] is session
        seen.append(session.key)
        gw.close_session(session.key)
    assert len(set(seen)) == KEY_QUARANTINE + 1  # bounded: the quarantine + peak concurrency (1)
    first_reuse = next(i for i, k in enumerate(seen) if k in seen[:i])
    assert first_reuse > KEY_QUARANTINE
    live = [gw.open_session(engine_key="0") for _ in range(10)]
    assert len({s.key for s in live}) == 10, "live sessions never share a key"


def test_seeded_episode_sends_a_seed_per_call(engines: list[HFEngineClient]) -> None:
    """Deterministic runs: the k-th call of a seeded session carries `sampling_seed = call_seed(seed, k)`
    (the request's own seed is replaced); an unseeded session passes the request's seed through."""

    async def main() -> None:
        async with Gateway(engines=engines[:1], seq_len=256) as gw:
            seeded = gw.open_session(engine_key="0", sampling=SamplingParams(max_tokens=3, seed=99))
            plain = gw.open_session(engine_key="0", sampling=SamplingParams(max_tokens=3))
            for turn in range(2):
                r = await _post(gw, _body(seeded.key, [5, 6, turn], seed=1))
                assert r.status_code == 200, r.text
            r = await _post(gw, _body(plain.key, [5, 6], seed=1))
            assert r.status_code == 200, r.text

    before = len(engines[0].requests)
    asyncio.run(main())
    sent = [req["sampling_params"] for req in engines[0].requests[before:]]
    assert [s.get("sampling_seed") for s in sent[:2]] == [call_seed(99, 0), call_seed(99, 1)]
    assert "seed" not in sent[0] and "seed" not in sent[1]
    assert sent[2].get("seed") == 1 and "sampling_seed" not in sent[2]


def test_gateway_connections_have_nagle_off(engines: list[HFEngineClient]) -> None:
    """Accepted connections are TCP_NODELAY: with Nagle on, an answer's body waited for the ACK of its
    headers (a 40 ms delayed-ACK stall on busy keep-alive connections)."""
    import socket

    async def main() -> None:
        async with Gateway(engines=engines[:1], seq_len=256) as gw, httpx.AsyncClient() as client:
            gw.open_session(engine_key="any")
            assert (await client.get(f"{gw.base_url}/v1/models")).status_code == 200
            connections = list(gw._server.server_state.connections)  # the keep-alive one is still open
            assert connections
            for protocol in connections:
                sock = protocol.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0

    asyncio.run(main())
