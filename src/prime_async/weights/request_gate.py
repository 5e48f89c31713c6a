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
(`watch_outages`), so dispatch is held at once. A watcher that registers with `retry=True` (it brings
the engines back with the served weights, `engines_back()`) makes the report an outage of the gate: the
failed call is held and retried by its gateway once `engines_back()` is called (`wait_engines`), and new
calls wait for it too, each at most until `outage_timeout_s` after the outage began. Without such a
watcher (eval, doctor) a failed call fails at once, as before.

Invariants: while the gate is closed, or the engines are down (an outage reported and not yet ended by
`engines_back()`), no request starts through it; `wait_idle()` returns once no request
that started through the gate is still running. One gate stands in front of one set of engines: the
orchestrator builds it first and passes it to every gateway of the training engines (training envs and
shared-placement eval) and to the watcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from prime_async.engine_api import EngineUnavailable

ENGINE_OUTAGE_TIMEOUT_S = 900.0  # an outage's deadline: the launcher's engine startup timeout (sglang)


class RequestGate:
    """Open by default; `close()` holds new requests, `open()` lets them (and the held ones) go."""

    def __init__(self, *, outage_timeout_s: float = ENGINE_OUTAGE_TIMEOUT_S) -> None:
        if outage_timeout_s <= 0:
            raise ValueError(f"outage_timeout_s must be > 0, got {outage_timeout_s}")
        self.outage_timeout_s = outage_timeout_s
        self._up = asyncio.Event()  # cleared by an outage (engine_failed) until engines_back()
        self._up.set()
        self._down_since = 0.0
        self._retry = False  # an outage watcher brings the engines back: held calls are retried
        self.num_outages = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self.num_held = 0  # requests that had to wait at a closed gate (cumulative)
        self._outage_handlers: list[Callable[[BaseException], None]] = []

    def watch_outages(self, handler: Callable[[BaseException], None], *, retry: bool = False) -> None:
        """`handler(error)` is called for every engine outage a gateway behind this gate meets. `retry`:
        the caller calls `engines_back()` once the engines answer again with the served weights, so the
        gateways hold and retry the calls an outage failed."""
        self._outage_handlers.append(handler)
        self._retry = self._retry or retry

    @property
    def retries_outages(self) -> bool:
        """Whether a call failed by an outage is held and retried (a watcher ends outages)."""
        return self._retry

    @property
    def engines_up(self) -> bool:
        return self._up.is_set()

    def engine_failed(self, error: BaseException) -> None:
        """A gateway could not reach an engine (refused, reset, timed out): with a retrying watcher the
        engines count as down (calls are held) until `engines_back()`."""
        self.mark_down()
        for handler in self._outage_handlers:
            handler(error)

    def mark_down(self) -> None:
        """With a retrying watcher: the engines are down (calls are held) until `engines_back()`."""
        if self._retry and self._up.is_set():
            self._up.clear()
            self._down_since = time.monotonic()
            self.num_outages += 1

    def engines_back(self) -> None:
        """The outage is over: every engine answers /health and serves the served weights."""
        self._up.set()

    async def wait_engines(self, who: str) -> None:
        """Wait until the engines are back, at most `outage_timeout_s` after the outage began; past it
        raise EngineUnavailable naming `who` and whom it waited on."""
        if self._up.is_set():
            return
        left = self._down_since + self.outage_timeout_s - time.monotonic()
        try:
            await asyncio.wait_for(self._up.wait(), timeout=max(left, 0.0))
        except TimeoutError:
            raise EngineUnavailable(
                f"{who} waited {self.outage_timeout_s:.0f} s for the inference engines to come back "
                "(the weight watcher's recovery: every engine's /health and the served weights)"
            ) from None

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Wait for the engines (an outage, `wait_engines`) and an open gate, then count the request as
        running until the block exits."""
        if not (self._up.is_set() and self._open.is_set()):
            self.num_held += 1
            while not (self._up.is_set() and self._open.is_set()):
                await self.wait_engines("a model call")
                await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
