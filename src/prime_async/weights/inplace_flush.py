"""The in-place update's flush gate: no new request reuses prefix KV computed under older weights.

    before the pause: close the gateways' request gate (new engine requests are held from here)
    after the load and resume: wait until the requests that were running finish, /flush_cache on every
    engine (SGLang flushes only when idle), reopen the gate

Without a gate (no gateway) admission is held until no episode is in flight, then the flush. The gate
reopens (or admission is released) whatever the flush raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prime_async.engine_api import EngineClient
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher_peers import Admission, Drainable


class InPlaceFlush:
    """Steps 1 and 5 of an `in_place` update (module docstring)."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        admission: Admission,
        groups: Drainable,
        request_gate: RequestGate | None,
    ):
        self.engines = engines
        self.admission = admission
        self.groups = groups
        self.request_gate = request_gate

    def close(self) -> None:
        """Before the pause: nothing may start between the load and the flush."""
        if self.request_gate is not None:
            self.request_gate.close()

    async def flush_when_idle(self) -> None:
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
