"""A model call in flight when its engine dies is held at the gateway and sent again once the engine is
back, instead of failing the episode (rollouts/gateway.py, weights/request_gate.py, weights/watcher.py).

Real parts: the gateway over HTTP, `HttpEngineClient`, a real `RequestGate` and `WeightWatcher`, and an
SGLang-shaped HTTP engine on a fixed port that refuses connections while it is down (as a SIGKILLed
inference server does) and comes back on the same port. Only the watcher's admission/broadcasts are fakes.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from loopback_server import serve_on_port
from prime_async.engine_api import SamplingParams
from prime_async.inference.client import HttpEngineClient
from prime_async.rollouts.gateway import GENERATE_ROUTE, Gateway
from prime_async.rollouts.seeds import call_seed
from prime_async.weights import engine_outage
from prime_async.weights import watcher as ww
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher_peers import WatcherSettings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """SGLang's `/generate`, `/health`, `/continue_generation` on `port`; `hang`: /generate never answers
    (a request running when the engine is killed). Every /generate body is kept in `requests`."""

    def __init__(self, port: int, *, answer: list[int], hang: bool = False) -> None:
        self.port, self.answer, self.hang = port, answer, hang
        self.requests: list[dict[str, Any]] = []
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    def _app(self) -> Starlette:
        async def generate(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            if self.hang:
                await asyncio.sleep(3600)
            meta = {
                "id": body.get("rid"), "finish_reason": {"type": "stop"},
                "prompt_tokens": len(body["input_ids"]), "weight_version": "0",
                "output_token_logprobs": [[-0.5, t, None] for t in self.answer],
            }  # fmt: skip
            return JSONResponse({"output_ids": self.answer, "meta_info": meta})

        async def ok(_request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        return Starlette(
            routes=[
                Route("/generate", generate, methods=["POST"]),
                Route("/health", ok),
                Route("/continue_generation", ok, methods=["POST"]),
            ]
        )

    async def start(self) -> Engine:
        self._server, self._task = await serve_on_port(self._app(), self.port, "engine")
        return self

    async def kill(self) -> None:
        """Down like a killed engine: open connections are cut, the port refuses."""
        assert self._server is not None and self._task is not None
        connections = list(self._server.server_state.connections)
        self._server.should_exit = self._server.force_exit = True
        await asyncio.wait_for(asyncio.gather(self._task, return_exceptions=True), timeout=10)  # port closed
        for conn in connections:
            conn.transport.abort()  # cut like a dead process: the client sees the connection reset
        self._server = self._task = None


class Admission:
    served_version, holds = 0, 0

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1

    def set_served_version(self, version: int) -> None:
        self.served_version = version


class Groups:
    num_inflight_groups = 0

    def cancel_unshippable(self) -> list[int]:
        return []

    async def wait_idle(self) -> None:
        return None


class NoBroadcasts:
    def latest_stable(self) -> int | None:
        return None

    def path(self, version: int) -> str:
        raise AssertionError("nothing to load")


async def _rig(port: int, gate: RequestGate, *, watcher: bool = True) -> tuple[Gateway, Any]:
    """A gateway on an `HttpEngineClient` at `port`, with the run's watcher on the same gate."""
    engine = HttpEngineClient(f"http://127.0.0.1:{port}")
    gateway = Gateway(engines=[engine], seq_len=64, gate=gate)
    task = None
    if watcher:
        w = ww.WeightWatcher(
            engines=[engine], loader=FilesystemLoader(NoBroadcasts()), admission=Admission(), groups=Groups(),
            settings=WatcherSettings("retract", 1, 0.05), request_gate=gate,
        )  # type: ignore[arg-type]  # fmt: skip
        task = asyncio.create_task(w.run())
    await gateway.start()
    return gateway, task


def _body(key: str) -> dict[str, Any]:
    return {"model": key, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "logprobs": 1}}


async def _post(gateway: Gateway, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{gateway.base_url}{GENERATE_ROUTE}", json=body)


async def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_outage, "BACKOFF_START_S", 0.05)
    monkeypatch.setattr(engine_outage, "BACKOFF_MAX_S", 0.1)


def test_call_killed_mid_request_is_sent_again_with_its_seed() -> None:
    """The engine dies with the call running (connection cut), refuses a while, then comes back: the
    episode's call is answered by the restarted engine, with the same prompt and sampling seed, and the
    session records exactly that one call (nothing of the killed attempt)."""

    async def main() -> None:
        port, gate = _free_port(), RequestGate(outage_timeout_s=30)
        dying = await Engine(port, answer=[9, 9], hang=True).start()
        gateway, task = await _rig(port, gate)
        session = gateway.open_session(engine_key="0", sampling=SamplingParams(max_tokens=4, seed=7))
        call = asyncio.create_task(_post(gateway, _body(session.key)))
        await _until(lambda: len(dying.requests) == 1)
        await dying.kill()
        await _until(lambda: not gate.engines_up)  # the gateway reported the outage
        await asyncio.sleep(0.3)  # refused for a while: health polls fail, the call stays held
        assert not call.done()
        back = await Engine(port, answer=[5, 6, 7]).start()
        resp = await asyncio.wait_for(call, timeout=20)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == [5, 6, 7]
        assert [c.output_ids for c in session.calls] == [[5, 6, 7]] and session.num_errors == 0
        (first,), (again,) = dying.requests, back.requests
        assert again["input_ids"] == first["input_ids"] == [1, 2, 3]
        assert again["sampling_params"] == first["sampling_params"]
        assert again["sampling_params"]["sampling_seed"] == call_seed(7, 0)
        assert again["rid"] != first["rid"]  # a fresh request id: the old one may linger elsewhere
        assert gateway.num_outage_retries == 1 and gate.engines_up
        task.cancel()
        await gateway.stop()
        await back.kill()

    asyncio.run(main())


def test_refused_call_waits_for_the_engine_then_runs() -> None:
    """An engine that refuses from the start: the call is held until it answers /health, then runs."""

    async def main() -> None:
        port, gate = _free_port(), RequestGate(outage_timeout_s=30)
        gateway, task = await _rig(port, gate)
        session = gateway.open_session(engine_key="0")
        call = asyncio.create_task(_post(gateway, _body(session.key)))
        await _until(lambda: not gate.engines_up)
        await asyncio.sleep(0.3)
        assert not call.done()
        engine = await Engine(port, answer=[4]).start()
        resp = await asyncio.wait_for(call, timeout=20)
        assert resp.status_code == 200, resp.text
        assert len(engine.requests) == 1 and [c.output_ids for c in session.calls] == [[4]]
        task.cancel()
        await gateway.stop()
        await engine.kill()

    asyncio.run(main())


def test_outage_past_its_deadline_fails_the_call_naming_the_wait() -> None:
    async def main() -> None:
        gate = RequestGate(outage_timeout_s=0.5)
        gateway, task = await _rig(_free_port(), gate)
        session = gateway.open_session(engine_key="0")
        resp = await asyncio.wait_for(_post(gateway, _body(session.key)), timeout=20)
        assert resp.status_code == 502
        assert "waited 0 s for the inference engines to come back" in resp.json()["error"]
        assert session.num_errors == 1 and session.calls == []
        task.cancel()
        await gateway.stop()

    asyncio.run(main())


def test_without_a_watcher_an_outage_fails_the_call_at_once() -> None:
    """Eval/doctor gateways (nobody ends outages): the old behaviour, an immediate 502."""

    async def main() -> None:
        gate = RequestGate(outage_timeout_s=30)
        gateway, _ = await _rig(_free_port(), gate, watcher=False)
        session = gateway.open_session(engine_key="0")
        resp = await asyncio.wait_for(_post(gateway, _body(session.key)), timeout=5)
        assert resp.status_code == 502 and session.num_errors == 1
        assert gateway.num_outage_retries == 0 and gate.engines_up
        await gateway.stop()

    asyncio.run(main())


def test_gate_rejects_a_non_positive_outage_deadline() -> None:
    with pytest.raises(ValueError, match="outage_timeout_s"):
        RequestGate(outage_timeout_s=0)
