"""Weight watcher: loads each new trainer version into every engine, in flight.

    trainer ── output_dir/broadcasts/step_N/{weights, STABLE} ─┐
            ── Published(N) on the control channel: wake() ────┴► WeightWatcher.run() (event-driven; the
                                                                   poll of `poll_interval_s` is a fallback)
      N >= served + weights.update_interval ?
        1. groups.cancel_unshippable()                  (saves compute; the sink sweep is the guarantee)
        2. pause: retract | in_place -> /pause_generation on every engine; drain -> hold admission and
           wait until no episode is in flight
        3. /update_weights_from_disk(step_N, weight_version=N) on every engine
           (flush_cache=True, except in_place: SGLang refuses to flush with paused requests), or with a
           `WeightLoader` (weights.transport = "distributed", `transfer.py`) its `load`
        4. served_version = N (admission re-checks), resume (/continue_generation or release admission)
        5. in_place only: new engine requests are held at the gateway's request gate from before the
           pause until the requests that were running finish; then /flush_cache on every engine and the
           gate reopens, so no new request (a running episode's next turn included) reuses prefix KV
           computed under older weights (DESIGN.md). Without a gate (no gateway): admission is held
           until no episode is in flight, then the flush.

Eval pin (`pin`, an asyncio.Lock): a shared-placement eval (`eval/in_run.py`) holds it for its whole
run and every update takes it first (`update_to`), so an update waits for the running eval and an eval
never spans two versions; the version to load is re-checked once the lock is held.

Deterministic runs (`schedule`, `orchestrator/schedule.py`): versions are loaded one by one (served + 1, never
skipping one), each only once every group scheduled for an older version was dispatched
(`schedule.wait_loadable`), with `drain` (the orchestrator forces it), so no group sees two versions.

Invariants: a broadcast directory is used only after its STABLE marker exists (a writer renames the
complete directory into place and writes STABLE last); the watcher never deletes broadcasts; versions
only increase; an engine error answer fails `run()` (supervised by the main loop).

Engine outage (e.g. the inference process died and the `rl` launcher restarts it): a transport-level
failure (connection refused/reset, timeout) seen by an update or reported by the gateway
(`engine_failed`) holds admission at once (no new groups are sent into a dead engine) and marks the
request gate down: the gateway holds a model call the outage failed and sends it again (same prompt,
same seed; its partial output discarded) once `_recover` calls `engines_back()`, so the episodes in
flight go on (`rollouts/gateway.py`; with a `WeightLoader`, whose restarted engine starts with the
initial model, `engines_back()` waits for its reload: the newest version, or in deterministic runs the
served one, loaded without waiting for the held groups). An update waiting for something the held
calls block (drain's idle groups, the deterministic schedule, the eval pin) gives way to the outage
(`_unless_down`) and is retried after the recovery. `run()` polls `/health` of every engine
with exponential backoff, releases admission and the held calls when all answer, and retries the newest
broadcast (the restarted engine may serve an older or newer version than `served_version`; loading the
newest makes them agree; the tokens record the version each was sampled with).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

from prime_async.engine_api import EngineClient, EngineUnavailable
from prime_async.types import PauseMode
from prime_async.utils.stall import StallWatch, waiting
from prime_async.weights.broadcasts import latest_stable, version_dir
from prime_async.weights.request_gate import RequestGate

logger = logging.getLogger(__name__)

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
        return latest_stable(self.root)

    def path(self, version: int) -> str:
        return str(version_dir(self.root, version))


class VersionGone(RuntimeError):
    """`WeightLoader.load`: the source no longer holds that version (newer ones replaced it)."""


class WeightLoader(Protocol):
    """Where versions come from and how they reach the engines, when not the broadcast directory.
    `load` raises `VersionGone` when the version is no longer held."""

    def latest(self) -> int | None: ...

    async def load(self, engines: Sequence[EngineClient], version: int, *, flush_cache: bool) -> None: ...

    def engines_restarted(self) -> None: ...


class Admission(Protocol):
    """The part of the orchestrator's admission (`orchestrator/admission.py`) the watcher drives: the
    served version new groups are stamped with, and holds while engines are paused or down."""

    served_version: int

    def set_served_version(self, version: int) -> None: ...

    def hold(self) -> None: ...

    def release(self) -> None: ...


class LoadSchedule(Protocol):
    """Deterministic runs (`orchestrator/schedule.py`): when version `version` may be loaded."""

    async def wait_loadable(self, version: int) -> None: ...


class Drainable(Protocol):
    """The part of the group table (`groups.py`) the watcher uses."""

    @property
    def num_inflight_groups(self) -> int: ...

    def cancel_unshippable(self) -> list[int]: ...

    async def wait_idle(self) -> None: ...


class UpdateSignal:
    """What wakes the weight watcher between polls: the trainer announced a version (`announce`), or
    the control channel failed (`fail`: the watcher's `run()` raises it). Built before the control
    channel and the watcher, and given to both in their constructors."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.failure: BaseException | None = None

    def announce(self) -> None:
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.event.set()


class WeightWatcher:
    """Polls for new STABLE broadcasts and runs the in-flight update protocol on every engine."""

    def __init__(
        self,
        *,
        engines: Sequence[EngineClient],
        broadcasts: Broadcasts,
        admission: Admission,
        groups: Drainable,
        pause_mode: PauseMode,
        update_interval: int,
        poll_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        request_gate: RequestGate | None = None,
        schedule: LoadSchedule | None = None,
        loader: WeightLoader | None = None,
        stalls: StallWatch | None = None,
        signal: UpdateSignal | None = None,
    ):
        self.engines = list(engines)
        self.stalls = stalls  # names the update's waits (utils/stall.py)
        self.schedule = schedule
        self.loader = loader  # None: the broadcast directory and /update_weights_from_disk
        self.request_gate = request_gate  # the gateways' one gate (request_gate.py): step 5, outages
        if request_gate is not None:
            # the watcher ends outages (engines_back): the gateways hold and retry the calls they failed
            request_gate.watch_outages(self.engine_failed, retry=True)
        self.broadcasts = broadcasts
        self.admission = admission
        self.groups = groups
        self.pause_mode = pause_mode
        self.interval = update_interval
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.signal = signal if signal is not None else UpdateSignal()
        self._wake = self.signal.event
        self.pin = asyncio.Lock()  # held by a shared-placement eval: updates wait for it
        self._sync_time = 0.0
        self._updates = 0
        self._inflight_at_update = 0
        self._engine_down = False
        self._down = asyncio.Event()  # set while `_engine_down`: the update's waits give way to recovery
        self._down_since = 0.0
        self._drain_held = False
        self._outages = 0
        self._health_retries = 0
        self._down_time = 0.0
        self._reload = False

    @property
    def served_version(self) -> int:
        return self.admission.served_version

    def wake(self) -> None:
        """Look for a new broadcast now instead of at the next poll."""
        self.signal.announce()

    def fail(self, error: BaseException) -> None:
        """A failure outside the watcher's task (the control channel): `run()` raises it at once."""
        self.signal.fail(error)

    def engine_failed(self, error: BaseException) -> None:
        """A transport-level engine failure: hold admission now; `run()` waits for health, then releases."""
        if not self._engine_down:
            self._engine_down = True
            self._down.set()
            self._down_since = self.clock()
            self._outages += 1
            self.admission.hold()
            if self.request_gate is not None:
                self.request_gate.mark_down()  # model calls are held too (retried when it is back)
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
        self._down.clear()
        if self.loader is not None:
            self.loader.engines_restarted()
            self._reload = True  # a restarted engine rejoins and gets the newest version, served or not
        self.admission.release()
        if self.request_gate is not None and not self._reload:
            # filesystem weights: the restarted engine serves the newest broadcast (launcher/restart.py);
            # a loader's restarted engine gets the run's weights first (run(): the reload, then this)
            self.request_gate.engines_back()  # the held model calls are sent again
        logger.warning("engines healthy again after %.1f s down: dispatch resumed", down)

    async def run(self) -> None:
        while True:
            if self.signal.failure is not None:
                raise self.signal.failure
            if self._engine_down:
                await self._recover()
            if self._reload and self.schedule is not None and self.served_version == 0:
                self._reload = False  # deterministic, v0 served: the restarted engine has the initial model
                self._engines_back()
            latest = self.latest()
            due = latest is not None and latest >= self.served_version + self.interval
            if latest is not None and (due or (self._reload and latest >= self.served_version)):
                # deterministic: every version in turn (a restarted engine reloads the served one)
                target = latest if self.schedule is None or not due else self.served_version + 1
                if self._reload and self.schedule is not None:  # the held calls' version first
                    target, due = self.served_version, False
                try:
                    await self.update_to(target, force=not due)
                    self._engines_back()
                except EngineUnavailable as e:
                    if self._drain_held:
                        self._drain_held = False
                        self.admission.release()
                    self.engine_failed(e)
                continue
            self._engines_back()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # a poll timeout is the normal case
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_interval_s)

    async def _unless_down(self, awaitable: Awaitable[object], version: int) -> None:
        """Await an update's wait unless an engine goes down first (then EngineUnavailable: `run()`
        recovers, then retries): the model calls held by the outage cannot finish before `_recover`
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

    def _engines_back(self) -> None:
        """After an outage, once the restarted engines serve the run's weights: the held calls go on."""
        if self.request_gate is not None and not self.request_gate.engines_up and not self._engine_down:
            self.request_gate.engines_back()

    def latest(self) -> int | None:
        """Newest version the trainer made available (announced, or STABLE on disk)."""
        return self.loader.latest() if self.loader is not None else self.broadcasts.latest_stable()

    async def update_to(self, version: int, *, force: bool = False) -> None:
        """`update(version)` once the eval pin is free, unless the engines already serve it (or newer);
        `force`: load it even when it is the served version (engines that restarted)."""
        if self.schedule is not None:
            with waiting(
                self.stalls, f"the groups scheduled before v{version}", peer="the inference engines"
            ):
                await self._unless_down(self.schedule.wait_loadable(version), version)
        with waiting(self.stalls, f"the pin to load v{version}", peer="the running in-run eval"):
            await self._unless_down(self.pin.acquire(), version)
        try:
            if version > self.served_version or (force and version == self.served_version):
                with waiting(self.stalls, f"weights v{version} to load ({self.pause_mode})",
                             peer=lambda: f"the inference engines ({self.groups.num_inflight_groups} groups "
                                          "in flight)"):  # fmt: skip
                    await self.update(version, force=force)
        finally:
            self.pin.release()

    async def update(self, version: int, *, force: bool = False) -> None:
        """Load `version` into every engine (steps 1-5 of the module docstring)."""
        assert version > self.served_version or (force and version == self.served_version), (
            f"weight version {version} <= served {self.served_version}"
        )
        start = self.clock()
        self.groups.cancel_unshippable()
        self._inflight_at_update += self.groups.num_inflight_groups  # work the update runs across
        if self.pause_mode == "in_place" and self.request_gate is not None:
            self.request_gate.close()  # before the pause: nothing may start between the load and the flush
        if self.pause_mode == "drain":
            self.admission.hold()
            self._drain_held = True
            if self.request_gate is not None and not self.request_gate.engines_up:
                # restarted engines' reload: the groups' calls are held at the gate until it is done,
                # so only the calls running on surviving engines are waited for
                await self.request_gate.wait_idle()
            else:
                await self._unless_down(self.groups.wait_idle(), version)
            # the trainer went on while the engines drained: load its newest version (the one asked for
            # may be gone from the trainer's memory or the broadcast retention); deterministic runs load
            # every version in turn
            newest = self.latest()
            if self.schedule is None and newest is not None and newest > version:
                version = newest
        else:
            await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in self.engines))
        if self._engine_down:  # it died while we paused or drained: `run()` recovers, then retries
            raise EngineUnavailable(f"an engine went down before weights v{version} could load")
        flush = self.pause_mode != "in_place"
        version = await self._load(version, flush)
        self._reload = False
        if version > self.served_version:
            self.admission.set_served_version(version)
        if self.pause_mode == "drain":
            self._drain_held = False
            self.admission.release()
        else:
            await asyncio.gather(*(e.continue_generation() for e in self.engines))
        self._sync_time += self.clock() - start
        self._updates += 1
        logger.info("weights v%d loaded into %d engine(s) (%s)", version, len(self.engines), self.pause_mode)
        if self.pause_mode == "in_place":
            await self._flush_when_idle(version)

    async def _load(self, version: int, flush: bool) -> int:
        """Load `version` into every engine (paused or drained); returns the version loaded. A loader
        that no longer holds it (the trainer kept only the newest) gets the newest instead, except in
        deterministic runs, which load every version in turn (and whose trainer holds K + 1)."""
        if self.loader is None:
            path = self.broadcasts.path(version)
            await asyncio.gather(
                *(e.update_weights_from_disk(path, version, flush_cache=flush) for e in self.engines)
            )
            return version
        try:
            await self.loader.load(self.engines, version, flush_cache=flush)
            return version
        except VersionGone:
            newest = self.latest()
            if self.schedule is not None or newest is None or newest <= version:
                raise
        logger.info(
            "weights v%d are gone from the trainer's memory: loading the newest, v%d", version, newest
        )
        await self.loader.load(self.engines, newest, flush_cache=flush)
        return newest

    async def _flush_when_idle(self, version: int) -> None:
        # New requests must not reuse prefix KV of older weights; SGLang flushes only when idle.
        if self.request_gate is not None:
            try:
                await self.request_gate.wait_idle()
                await asyncio.gather(*(e.flush_cache() for e in self.engines))
            finally:
                self.request_gate.open()
            return
        self.admission.hold()
        try:
            await self.groups.wait_idle()
            await asyncio.gather(*(e.flush_cache() for e in self.engines))
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
