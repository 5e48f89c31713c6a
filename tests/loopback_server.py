"""A uvicorn server on a fixed loopback port that a test can stop and start again (an engine that dies and
comes back on the same port), shared by the fake engines of the outage tests."""

from __future__ import annotations

import asyncio
import socket
from typing import Any


async def serve_on_port(app: Any, port: int, what: str) -> tuple[Any, asyncio.Task]:
    """Serve `app` on 127.0.0.1:`port`; return (server, task) once it accepts, or raise naming `what`."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(1000):
        if server.started:
            return server, task
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{what} did not start within 10 s")
