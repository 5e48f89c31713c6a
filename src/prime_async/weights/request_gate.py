"""Request gate: holds new engine requests while an engine's prefix cache may hold KV of older weights.

Used by the gateway (every engine request passes `async with gate.request()`) and by the weight watcher
(the `in_place` update closes the gate, loads the weights, waits until the requests that were running
finish, flushes every engine's cache, reopens the gate).

Why: after an `in_place` update SGLang keeps the KV of paused requests (the seed's semantics) and cannot
flush its prefix cache while they run; any request that starts meanwhile, including the next turn of a
running multi-turn episode, may reuse prefix KV computed under the old weights. Holding new requests at
the gateway until the flush closes that window without waiting for whole episodes to end.

The gate is also where gateways report an engine that is gone (`engine_failed`, a transport-level
failure): the weight watcher, which gets the gate in its constructor, handles those reports
(`watch_outages`), so dispatch is held at once.

Invariants: while the gate is closed no request starts through it; `wait_idle()` returns once no request
that started through the gate is still running. One gate stands in front of one set of engines: the
orchestrator builds it first and passes it to every gateway of the training engines (training envs and
shared-placement eval) and to the watcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class RequestGate:
    """Open by default; `close()` holds new requests, `open()` lets them (and the held ones) go."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self.num_held = 0  # requests that had to wait at a closed gate (cumulative)
        self._outage_handlers: list[Callable[[BaseException], None]] = []

    def watch_outages(self, handler: Callable[[BaseException], None]) -> None:
        """`handler(error)` is called for every engine outage a gateway behind this gate meets."""
        self._outage_handlers.append(handler)

    def engine_failed(self, error: BaseException) -> None:
        """A gateway could not reach an engine (refused, reset, timed out)."""
        for handler in self._outage_handlers:
            handler(error)

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def num_active(self) -> int:
        return self._active

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Wait for an open gate, then count the request as running until the block exits."""
        if not self._open.is_set():
            self.num_held += 1
            await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
