"""Weight watcher: loads each new trainer version into every engine, in flight.

    trainer ── output_dir/broadcasts/step_N/{weights, STABLE} ─┐
            ── Published(N) on the control channel: wake() ────┴► WeightWatcher.run() (event-driven; the
                                                                   poll of `poll_interval_s` is a fallback)
      N >= served + weights.update_interval ?
        1. groups.cancel_unshippable()                  (saves compute; the sink sweep is the guarantee)
        2. pause: retract | in_place -> /pause_generation on every engine; drain -> hold admission and
           wait until no episode is in flight
        3. the `WeightLoader` of weights.transport loads N into every engine (`weights/loaders/`; the
           filesystem one: /update_weights_from_disk(step_N, weight_version=N)), with flush_cache=True
           except in_place (SGLang refuses to flush with paused requests)
        4. served_version = N (admission re-checks), resume (/continue_generation or release admission)
        5. in_place only: new engine requests are held at the gateway's request gate from before the
           pause until the requests that were running finish; then /flush_cache on every engine and the
           gate reopens, so no new request (a running episode's next turn included) reuses prefix KV
           computed under older weights (DESIGN.md). Without a gate (no gateway): admission is held
           until no episode is in flight, then the flush.

Parts, one concern each: `EngineOutage` (`engine_outage.py`: held dispatch, health backoff, outage
metrics), `UpdateGates` (`update_gates.py`: the deterministic schedule and the eval pin an update waits
for), `InPlaceFlush` (`inplace_flush.py`: step 5), `UpdateStats` (the update metrics), the
`WeightLoader` (`weights/loaders/`: step 3); what it drives of the orchestrator is in `watcher_peers.py`.
This class keeps the protocol (steps 1-5), the choice of the version to load, and the recovery order.

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
(`EngineOutage.unless_down`) and is retried after the recovery. `run()` polls `/health` of every engine
with exponential backoff, releases admission and the held calls when all answer, and retries the newest
broadcast (the restarted engine may serve an older or newer version than `served_version`; loading the
newest makes them agree; the tokens record the version each was sampled with).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prime_async.engine_api import EngineClient, EngineUnavailable
from prime_async.utils.stall import StallWatch, waiting
from prime_async.weights.engine_outage import EngineOutage
from prime_async.weights.inplace_flush import InPlaceFlush
from prime_async.weights.loaders.base import VersionGone, WeightLoader
from prime_async.weights.probe_check import WeightProbe
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.update_gates import UpdateGates
from prime_async.weights.watcher_peers import Admission, Drainable, LoadSchedule, WatcherSettings

logger = logging.getLogger(__name__)


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


@dataclass
class UpdateStats:
    """The `weights/*` and `time/sync_weights` counts of one metrics window."""

    sync_time: float = 0.0
    updates: int = 0
    inflight_at_update: int = 0

    def window(self, served_version: int) -> dict[str, float]:
        """This window's counts (then zeroed)."""
        out = {
            "time/sync_weights": self.sync_time,
            "weights/served_version": float(served_version),
            "weights/updates": float(self.updates),
            "weights/inflight_groups_at_update": float(self.inflight_at_update),
        }
        self.sync_time, self.updates, self.inflight_at_update = 0.0, 0, 0
        return out


class WeightWatcher:
    """Watches for new versions and runs the in-flight update protocol on every engine."""

    def __init__(
        self,
        *,
        engines: Sequence[EngineClient],
        loader: WeightLoader,
        admission: Admission,
        groups: Drainable,
        settings: WatcherSettings,
        clock: Callable[[], float] = time.monotonic,
        request_gate: RequestGate | None = None,
        schedule: LoadSchedule | None = None,
        stalls: StallWatch | None = None,
        signal: UpdateSignal | None = None,
        probe: WeightProbe | None = None,
    ):
        # the run's one engine list, kept (not copied): the elastic pool changes it under `pin`
        self.engines = engines if isinstance(engines, list) else list(engines)
        self.probe = probe  # the check after every load (probe_check.py), run once generation resumed
        self.loader = loader  # weights/loaders/: where versions come from, how they reach the engines
        self.admission = admission
        self.groups = groups
        self.pause_mode = settings.pause_mode
        self.interval = settings.update_interval
        self.poll_interval_s = settings.poll_interval_s
        self.clock = clock
        self.schedule = schedule
        self.stalls = stalls  # names the update's waits (utils/stall.py)
        self.request_gate = request_gate  # the gateways' one gate (request_gate.py): step 5, outages
        self.signal = signal if signal is not None else UpdateSignal()
        self._wake = self.signal.event
        self.outage = EngineOutage(self.engines, admission, request_gate, clock)
        self.gates = UpdateGates(self.outage, schedule, stalls)
        self.flush = InPlaceFlush(self.engines, admission, groups, request_gate)
        self.stats = UpdateStats()
        self._drain_held = False
        self._reload = False
        if request_gate is not None:
            # the watcher ends outages (engines_back): the gateways hold and retry the calls they failed
            request_gate.watch_outages(self.engine_failed, retry=True)

    @property
    def served_version(self) -> int:
        return self.admission.served_version

    @property
    def pin(self) -> asyncio.Lock:
        """The eval pin (`update_gates.py`): held by a shared-placement eval, taken by every update."""
        return self.gates.pin

    def wake(self) -> None:
        """Look for a new broadcast now instead of at the next poll."""
        self.signal.announce()

    def fail(self, error: BaseException) -> None:
        """A failure outside the watcher's task (the control channel): `run()` raises it at once."""
        self.signal.fail(error)

    def engine_failed(self, error: BaseException) -> None:
        """A transport-level engine failure: hold admission now; `run()` waits for health, then releases."""
        self.outage.failed(error)
        self._wake.set()

    async def _recover(self) -> None:
        """Wait until every engine is healthy (`EngineOutage`), then resume dispatch."""
        down = await self.outage.wait_healthy()
        if self.loader.engines_restarted():
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
            if self.outage.down:
                await self._recover()
            if self._reload and self.schedule is not None and self.served_version == 0:
                self._reload = False  # deterministic, v0 served: the restarted engine has the initial model
                self._engines_back()
            target = self._target()
            if target is not None:
                await self._try_update(*target)
                continue
            self._engines_back()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # a poll timeout is the normal case
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_interval_s)

    def _target(self) -> tuple[int, bool] | None:
        """(version to load, due) when one should load now, else None. Due: `update_interval` ahead of
        the served one; not due: a restarted engine reloads. Deterministic: every version in turn (a
        restarted engine reloads the served one first: the held calls' version)."""
        latest = self.latest()
        due = latest is not None and latest >= self.served_version + self.interval
        if latest is None or not (due or (self._reload and latest >= self.served_version)):
            return None
        target = latest if self.schedule is None or not due else self.served_version + 1
        if self._reload and self.schedule is not None:
            return self.served_version, False
        return target, due

    async def _try_update(self, target: int, due: bool) -> None:
        try:
            await self.update_to(target, force=not due)
            self._engines_back()
        except EngineUnavailable as e:
            if self._drain_held:
                self._drain_held = False
                self.admission.release()
            self.engine_failed(e)

    def _engines_back(self) -> None:
        """After an outage, once the restarted engines serve the run's weights: the held calls go on."""
        if self.request_gate is not None and not self.request_gate.engines_up and not self.outage.down:
            self.request_gate.engines_back()

    def latest(self) -> int | None:
        """Newest version the trainer made available (announced, or STABLE on disk)."""
        return self.loader.latest()

    async def update_to(self, version: int, *, force: bool = False) -> None:
        """`update(version)` once the schedule and the eval pin let it (`UpdateGates`), unless the engines
        already serve it (or newer); `force`: load it even when it is the served version (engines that
        restarted)."""
        async with self.gates.passed(version):
            if version > self.served_version or (force and version == self.served_version):
                with waiting(self.stalls, f"weights v{version} to load ({self.pause_mode})",
                             peer=lambda: f"the inference engines ({self.groups.num_inflight_groups} groups "
                                          "in flight)"):  # fmt: skip
                    await self.update(version, force=force)

    async def update(self, version: int, *, force: bool = False) -> None:
        """Load `version` into every engine (steps 1-5 of the module docstring)."""
        assert version > self.served_version or (force and version == self.served_version), (
            f"weight version {version} <= served {self.served_version}"
        )
        start = self.clock()
        self.groups.cancel_unshippable()
        self.stats.inflight_at_update += self.groups.num_inflight_groups  # work the update runs across
        version = await self._pause(version)
        if self.outage.down:  # it died while we paused or drained: `run()` recovers, then retries
            raise EngineUnavailable(f"an engine went down before weights v{version} could load")
        version = await self._load(version, flush=self.pause_mode != "in_place")
        self._reload = False
        if version > self.served_version:
            self.admission.set_served_version(version)
        if self.pause_mode == "drain":
            self._drain_held = False
            self.admission.release()
        else:
            await asyncio.gather(*(e.continue_generation() for e in self.engines))
        self.stats.sync_time += self.clock() - start
        self.stats.updates += 1
        logger.info("weights v%d loaded into %d engine(s) (%s)", version, len(self.engines), self.pause_mode)
        if self.pause_mode == "in_place":
            await self.flush.flush_when_idle()
        if self.probe is not None:
            await self.probe.check(version)  # concurrent with generation; before the next update

    async def _pause(self, version: int) -> int:
        """Step 2: pause the engines, or drain (hold admission, wait until no episode is in flight).
        Returns the version to load: a drain loads the newest one (below)."""
        if self.pause_mode == "in_place":
            self.flush.close()  # before the pause: nothing may start between the load and the flush
        if self.pause_mode != "drain":
            await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in self.engines))
            return version
        self.admission.hold()
        self._drain_held = True
        if self.request_gate is not None and not self.request_gate.engines_up:
            # restarted engines' reload: the groups' calls are held at the gate until it is done,
            # so only the calls running on surviving engines are waited for
            await self.request_gate.wait_idle()
        else:
            await self.outage.unless_down(self.groups.wait_idle(), version)
        # the trainer went on while the engines drained: load its newest version (the one asked for
        # may be gone from the trainer's memory or the broadcast retention); deterministic runs load
        # every version in turn
        newest = self.latest()
        if self.schedule is None and newest is not None and newest > version:
            return newest
        return version

    async def _load(self, version: int, flush: bool) -> int:
        """Load `version` into every engine (paused or drained); returns the version loaded. A loader
        that no longer holds it (the trainer kept only the newest) gets the newest instead, except in
        deterministic runs, which load every version in turn (and whose trainer holds K + 1)."""
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

    def metrics(self) -> dict[str, float]:
        """Weight updates and outages since the last call (then reset), and the served version."""
        probe = self.probe.metrics() if self.probe is not None else {}
        engines = {"inference/engines": float(len(self.engines))}  # the live count (engine_pool.py)
        return {**self.stats.window(self.served_version), **self.outage.metrics(), **probe, **engines}
