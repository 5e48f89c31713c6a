"""What a weight update waits for before it may pause the engines: the deterministic schedule and the
eval pin.

Eval pin (`pin`, an asyncio.Lock): a shared-placement eval (`eval/in_run.py`) holds it for its whole
run and every update takes it first, so an update waits for the running eval and an eval never spans two
versions; the watcher re-checks the version to load once the lock is held.

Deterministic runs (`schedule`, `orchestrator/schedule.py`): version N loads only once every group
scheduled for an older version was dispatched (`schedule.wait_loadable`).

Both waits give way to an engine outage (`EngineOutage.unless_down`); every wait is named to `stalls`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prime_async.utils.stall import StallWatch, waiting
from prime_async.weights.engine_outage import EngineOutage
from prime_async.weights.watcher_peers import LoadSchedule


class UpdateGates:
    """The schedule's and the eval pin's waits of one update (see the module docstring)."""

    def __init__(
        self, outage: EngineOutage, schedule: LoadSchedule | None = None, stalls: StallWatch | None = None
    ):
        self.outage = outage
        self.schedule = schedule
        self.stalls = stalls
        self.pin = asyncio.Lock()  # held by a shared-placement eval: updates wait for it

    @contextlib.asynccontextmanager
    async def passed(self, version: int) -> AsyncIterator[None]:
        """Inside: version `version` may load (the schedule allows it, the pin is held)."""
        if self.schedule is not None:
            with waiting(
                self.stalls, f"the groups scheduled before v{version}", peer="the inference engines"
            ):
                await self.outage.unless_down(self.schedule.wait_loadable(version), version)
        with waiting(self.stalls, f"the pin to load v{version}", peer="the running in-run eval"):
            await self.outage.unless_down(self.pin.acquire(), version)
        try:
            yield
        finally:
            self.pin.release()
