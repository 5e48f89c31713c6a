"""Weight watcher: loads each new trainer broadcast into every engine, in flight.

    trainer ── output_dir/broadcasts/step_N/{weights, STABLE} ──► WeightWatcher.run() polls
      N >= served + update_weights_interval ?
        1. dispatcher.cancel_unshippable()              (saves compute; the sink sweep is the guarantee)
        2. pause: retract | in_place -> /pause_generation on every engine; drain -> hold admission and
           wait until no episode is in flight
        3. /update_weights_from_disk(step_N, weight_version=N) on every engine
           (flush_cache=True, except in_place: SGLang refuses to flush with paused requests)
        4. served_version = N (admission re-checks), resume (/continue_generation or release admission)
        5. in_place only: hold admission until in-flight episodes finish, then /flush_cache on every
           engine, so no new request reuses prefix KV computed under older weights (DESIGN.md)

Invariants: a broadcast directory is used only after its STABLE marker exists (a writer renames the
complete directory into place and writes STABLE last); the watcher never deletes broadcasts; versions
only increase; an engine error answer fails `run()` (supervised by the main loop).

Engine outage (e.g. the inference process died and the `rl` launcher restarts it): a transport-level
failure (connection refused/reset, timeout) seen by an update or reported by the gateway
(`engine_failed`) holds admission at once (no new groups are sent into a dead engine; episodes already
in flight end as errors and are retried), then `run()` polls `/health` of every engine with exponential
backoff, releases admission when all answer, and retries the newest broadcast (the restarted engine
may serve an older or newer version than `served_version`; loading the newest makes them agree).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, Protocol

import httpx

from prime_async.inference.types import EngineClient
from prime_async.orchestrator.admission import AdmissionController

logger = logging.getLogger(__name__)

PauseModeConfig = Literal["retract", "in_place", "drain"]
_STEP_DIR = re.compile(r"^step_(\d+)$")
ENGINE_DOWN_ERRORS = (httpx.TransportError, ConnectionError)
BACKOFF_START_S, BACKOFF_MAX_S = 0.5, 8.0


class Broadcasts(Protocol):
    """Where published weight versions are found."""

    def latest_stable(self) -> int | None: ...

    def path(self, version: int) -> str: ...


class BroadcastDir:
    """`root/step_N/` directories; a version counts only once `root/step_N/STABLE` exists."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def latest_stable(self) -> int | None:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return None
        versions = sorted((int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))), reverse=True)
        for version in versions:
            if (self.root / f"step_{version}" / "STABLE").exists():
                return version
        return None

    def path(self, version: int) -> str:
        return str(self.root / f"step_{version}")


class Drainable(Protocol):
    """The part of the dispatcher the watcher uses."""

    @property
    def num_inflight_groups(self) -> int: ...

    def cancel_unshippable(self) -> list[int]: ...

    async def wait_idle(self) -> None: ...


class WeightWatcher:
    """Polls for new STABLE broadcasts and runs the in-flight update protocol on every engine."""

    def __init__(
        self,
        *,
        engines: Sequence[EngineClient],
        broadcasts: Broadcasts,
        admission: AdmissionController,
        dispatcher: Drainable,
        pause_mode: PauseModeConfig,
        update_weights_interval: int,
        poll_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engines = list(engines)
        self.broadcasts = broadcasts
        self.admission = admission
        self.dispatcher = dispatcher
        self.pause_mode = pause_mode
        self.interval = update_weights_interval
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self._wake = asyncio.Event()
        self._sync_time = 0.0
        self._updates = 0
        self._inflight_at_update = 0
        self.events: list[tuple[str, int]] = []  # (what, version), for tests and debugging
        self._engine_down = False
        self._down_since = 0.0
        self._drain_held = False
        self._outages = 0
        self._health_retries = 0
        self._down_time = 0.0

    @property
    def served_version(self) -> int:
        return self.admission.served_version

    def wake(self) -> None:
        """Look for a new broadcast now instead of at the next poll."""
        self._wake.set()

    def engine_failed(self, error: BaseException) -> None:
        """A transport-level engine failure: hold admission now; `run()` waits for health, then releases."""
        if not self._engine_down:
            self._engine_down = True
            self._down_since = self.clock()
            self._outages += 1
            self.admission.hold()
            logger.warning("engine unreachable (%s: %s): dispatch held until /health answers",
                           type(error).__name__, error)  # fmt: skip
        self._wake.set()

    async def _recover(self) -> None:
        """Poll every engine's /health with exponential backoff, then resume dispatch."""
        delay = BACKOFF_START_S
        while not all(await asyncio.gather(*(e.health() for e in self.engines))):
            self._health_retries += 1
            logger.info("engines not healthy yet: retry in %.1f s", delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX_S)
        for engine in self.engines:  # an engine that survived a failed pause must not stay paused
            with contextlib.suppress(Exception):  # tolerated: best effort, the next update re-pauses
                await engine.continue_generation()
        down = self.clock() - self._down_since
        self._down_time += down
        self._engine_down = False
        self.admission.release()
        logger.warning("engines healthy again after %.1f s down: dispatch resumed", down)

    async def run(self) -> None:
        while True:
            if self._engine_down:
                await self._recover()
            latest = self.broadcasts.latest_stable()
            if latest is not None and latest >= self.served_version + self.interval:
                try:
                    await self.update(latest)
                except ENGINE_DOWN_ERRORS as e:
                    if self._drain_held:
                        self._drain_held = False
                        self.admission.release()
                    self.engine_failed(e)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # a poll timeout is the normal case
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_interval_s)

    async def update(self, version: int) -> None:
        """Load broadcast `version` into every engine (steps 1-5 of the module docstring)."""
        assert version > self.served_version, f"weight version {version} <= served {self.served_version}"
        start = self.clock()
        cancelled = self.dispatcher.cancel_unshippable()
        self.events.append(("cancel", len(cancelled)))
        self._inflight_at_update += self.dispatcher.num_inflight_groups  # work the update runs across
        path = self.broadcasts.path(version)
        if self.pause_mode == "drain":
            self.admission.hold()
            self._drain_held = True
            await self.dispatcher.wait_idle()
        else:
            await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in self.engines))
        self.events.append(("paused", version))
        flush = self.pause_mode != "in_place"
        await asyncio.gather(
            *(e.update_weights_from_disk(path, version, flush_cache=flush) for e in self.engines)
        )
        self.events.append(("updated", version))
        self.admission.set_served_version(version)
        if self.pause_mode == "drain":
            self._drain_held = False
            self.admission.release()
        else:
            await asyncio.gather(*(e.continue_generation() for e in self.engines))
        self.events.append(("resumed", version))
        self._sync_time += self.clock() - start
        self._updates += 1
        logger.info("weights v%d loaded into %d engine(s) (%s)", version, len(self.engines), self.pause_mode)
        if self.pause_mode == "in_place":
            await self._flush_when_idle(version)

    async def _flush_when_idle(self, version: int) -> None:
        # New requests must not reuse prefix KV of older weights; SGLang flushes only when idle.
        self.admission.hold()
        try:
            await self.dispatcher.wait_idle()
            await asyncio.gather(*(e.flush_cache() for e in self.engines))
            self.events.append(("flushed", version))
        finally:
            self.admission.release()

    def window_metrics(self) -> dict[str, float]:
        out = {
            "time/sync_weights": self._sync_time,
            "weights/served_version": float(self.served_version),
            "weights/updates": float(self._updates),
            "weights/inflight_groups_at_update": float(self._inflight_at_update),
            "engine/outages": float(self._outages),
            "engine/health_retries": float(self._health_retries),
            "engine/down_time": self._down_time,
        }
        self._sync_time = 0.0
        self._updates = 0
        self._inflight_at_update = 0
        return out
