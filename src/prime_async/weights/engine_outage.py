"""An engine outage as the weight watcher sees it: held dispatch, health polling with backoff, the
outage metrics.

    failed(error)      a transport-level failure (an update's, or the gateway's `engine_failed`):
                       admission held, the request gate marked down (the gateway holds the model calls
                       the outage failed, and sends them again once the watcher calls `engines_back()`)
    wait_healthy()     poll `/health` of every engine with exponential backoff until all answer, tell
                       every engine to continue (none may stay paused), end the outage
    unless_down(aw)    an update's wait that gives way to an outage (EngineUnavailable)

Invariants: one outage is counted once however many failures report it; while `down` the admission
hold this outage took is not released here (the watcher releases it after its recovery steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from prime_async.engine_api import EngineClient, EngineUnavailable
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher_peers import Admission

logger = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_MAX_S = 0.5, 8.0


class EngineOutage:
    """Whether an engine is down, since when, and the `engine/*` counts of the metrics window."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        admission: Admission,
        request_gate: RequestGate | None,
        clock: Callable[[], float],
    ):
        self.engines = engines
        self.admission = admission
        self.request_gate = request_gate
        self.clock = clock
        self.down = False
        self._down = asyncio.Event()  # set while `down`: an update's waits give way to recovery
        self._since = 0.0
        self.outages = 0
        self.health_retries = 0
        self.down_time = 0.0

    def failed(self, error: BaseException) -> None:
        """Hold admission and the model calls now, once per outage."""
        if self.down:
            return
        self.down = True
        self._down.set()
        self._since = self.clock()
        self.outages += 1
        self.admission.hold()
        if self.request_gate is not None:
            self.request_gate.mark_down()  # model calls are held too (retried when it is back)
        logger.warning("engine unreachable (%s: %s): dispatch held until /health answers",
                       type(error).__name__, error)  # fmt: skip

    async def wait_healthy(self) -> float:
        """Poll every engine's /health with exponential backoff; then end the outage. Returns the
        seconds it lasted."""
        delay = BACKOFF_START_S
        while not all(await asyncio.gather(*(e.health() for e in self.engines))):
            self.health_retries += 1
            logger.info("engines not healthy yet: retry in %.1f s", delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX_S)
        for engine in list(self.engines):  # an engine that survived a failed pause must not stay paused
            with contextlib.suppress(Exception):  # tolerated: best effort, the next update re-pauses
                await engine.continue_generation()
        down = self.clock() - self._since
        self.down_time += down
        self.down = False
        self._down.clear()
        return down

    async def unless_down(self, awaitable: Awaitable[object], version: int) -> None:
        """Await an update's wait unless an engine goes down first (then EngineUnavailable: the watcher
        recovers, then retries): the model calls held by the outage cannot finish before the recovery
        reopens the gate, so a wait for groups, the schedule or the eval pin must not hold it up."""
        task = asyncio.ensure_future(awaitable)
        down = asyncio.ensure_future(self._down.wait())
        try:
            await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
        if task.done():
            task.result()
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise EngineUnavailable(f"an engine went down before weights v{version} could load")

    def metrics(self) -> dict[str, float]:
        return {
            "engine/outages": float(self.outages),
            "engine/health_retries": float(self.health_retries),
            "engine/down_time": self.down_time,
        }
