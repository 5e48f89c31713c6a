"""LoRA (`lora` set, over the broadcast directory): each version is a PEFT adapter directory
`broadcasts/step_N/`, loaded into every engine as adapter `vN` (`/load_lora_adapter`) by the engines'
`LoraEngineClient` (`weights/lora_client.py`), which also names that adapter on every request.

Invariants: as the filesystem loader (STABLE first, nothing deleted, a restarted engine needs no
reload); the engines are `LoraEngineClient`s (`inference/client.py`'s `engine_clients(lora=True)`):
anything else is refused before any engine is asked, since it could not name the adapter per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prime_async.engine_api import EngineClient
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.lora_client import LoraEngineClient


class LoraLoader(FilesystemLoader):
    """`WeightLoader` of LoRA adapters (no cache flush: adapters have their own prefix-cache namespace)."""

    async def load(self, engines: Sequence[EngineClient], version: int, *, flush_cache: bool) -> None:
        clients = [e for e in engines if isinstance(e, LoraEngineClient)]
        if len(clients) != len(engines):
            raise TypeError(
                "a LoRA run loads adapters through LoraEngineClient engines (engine_clients(lora=True))"
            )
        path = self.broadcasts.path(version)
        await asyncio.gather(*(c.load_adapter(path, version) for c in clients))
