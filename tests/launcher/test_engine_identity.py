"""An engine that belongs to another run is refused, by the launcher and by the orchestrator.

A stand-in engine (a real HTTP server on a free loopback port) answers `/model_info` the way the embedded
engine (with `run_id`) or SGLang (model path and weight version only) does; the real checks query it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prime_async.config.loader import load_config
from prime_async.config.rl import RLConfig
from prime_async.inference.client import HttpEngineClient
from prime_async.launcher.identity import check_engine_identity
from prime_async.rollouts.engine_checks import check_engines_belong_to_run, check_served_not_ahead


@pytest.fixture
def engine() -> Iterator[tuple[int, dict]]:
    """(port, info): an HTTP server whose `/model_info` returns `info` (mutable by the test)."""
    info: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(info).encode()
            self.send_response(200 if self.path == "/model_info" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], info
    finally:
        server.shutdown()
        server.server_close()


def _config(tmp_path: Path, port: int) -> RLConfig:
    model = tmp_path / "model"
    args = ["--model.path", str(model), "--output-dir", str(tmp_path / "out")]
    return load_config(
        RLConfig,
        [*args, "--inference.server.port", str(port)],
    ).model_copy(update={"run_id": "run-a"})


def test_launcher_refuses_an_engine_of_another_run(tmp_path: Path, engine: tuple[int, dict]) -> None:
    port, info = engine
    cfg = _config(tmp_path, port)
    model = str(cfg.inference.model.path)
    info.update(run_id="run-a", model_path=model, weight_version="0")
    check_engine_identity(cfg)  # ours: accepted
    info.update(run_id="run-b")
    ours = rf"127\.0\.0\.1:{port} belongs to run run-b, not to this run run-a"
    with pytest.raises(RuntimeError, match=ours):
        check_engine_identity(cfg)
    info.pop("run_id")  # an SGLang server: judged by what it serves
    info.update(model_path="/elsewhere/model")
    with pytest.raises(RuntimeError, match=r"serves '/elsewhere/model', not this run's model"):
        check_engine_identity(cfg)
    info.update(model_path=model, weight_version="3")  # e.g. a leftover of a run that trained 3 steps
    with pytest.raises(RuntimeError, match=r"serves weight version '3', not this run's initial version 0"):
        check_engine_identity(cfg)


def test_orchestrator_refuses_an_engine_of_another_run(engine: tuple[int, dict]) -> None:
    port, info = engine
    info.update(run_id="run-b", model_path="m", weight_version="0")

    async def check(run_id: str | None, model_path: str = "m") -> None:
        client = HttpEngineClient(f"http://127.0.0.1:{port}", None)
        try:
            await check_engines_belong_to_run(
                [client], run_id, model_path=model_path, broadcasts=Path("/o/b")
            )
        finally:
            await client.aclose()

    asyncio.run(check("run-b"))
    asyncio.run(check(None))  # a run without an id checks nothing
    with pytest.raises(RuntimeError, match=r"belongs to run run-b, not to run-a"):
        asyncio.run(check("run-a"))
    # the orchestrator starts with the engines, so it makes the launcher's SGLang check itself: an
    # engine that reports no run id must serve this run's model
    info.pop("run_id")
    asyncio.run(check("run-a"))
    with pytest.raises(RuntimeError, match=r"serves 'm', not this run's model '/other'"):
        asyncio.run(check("run-a", model_path="/other"))
    info.update(model_path="/o/b/step_3")  # a restarted engine serves one of this run's broadcasts
    asyncio.run(check("run-a", model_path="/other"))


def test_an_engine_ahead_of_the_first_batch_is_refused() -> None:
    check_served_not_ahead(served_version=5, start_step=5)
    with pytest.raises(RuntimeError, match=r"serves weight version 6 but this orchestrator starts at step 5"):
        check_served_not_ahead(served_version=6, start_step=5)
