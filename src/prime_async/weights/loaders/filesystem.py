"""`weights.transport = "filesystem"`: versions are `broadcasts/step_N/` directories (complete once STABLE
exists), loaded with `/update_weights_from_disk` on every engine concurrently.

Invariants: a directory is used only after its STABLE marker exists (the trainer renames the complete
directory into place and writes STABLE last); the loader never deletes broadcasts; a restarted engine
serves the newest broadcast already (`launcher/restart.py`), so an outage needs no reload.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prime_async.engine_api import EngineClient
from prime_async.weights.broadcasts import Broadcasts
from prime_async.weights.control import Published


class FilesystemLoader:
    """`WeightLoader` over the broadcast directory (the announcement only wakes the watcher)."""

    def __init__(self, broadcasts: Broadcasts):
        self.broadcasts = broadcasts

    def latest(self) -> int | None:
        return self.broadcasts.latest_stable()

    def on_published(self, msg: Published) -> None:
        """Nothing to remember: the directory is the record."""

    async def load(self, engines: Sequence[EngineClient], version: int, *, flush_cache: bool) -> None:
        path = self.broadcasts.path(version)
        await asyncio.gather(
            *(e.update_weights_from_disk(path, version, flush_cache=flush_cache) for e in engines)
        )

    def engines_restarted(self) -> bool:
        return False
