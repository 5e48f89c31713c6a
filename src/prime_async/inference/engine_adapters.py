"""The embedded engine's LoRA adapters by name (`Engine.load_lora_adapter` / `unload_lora_adapter`).

    read(name, path)    off the engine thread: read and validate the files (`lora.read_adapter`: rank at
                        most `max_rank`, only the allowed modules, shapes of this model)
    register(raw)       engine thread: fold into the runner's adapter table (`runner.adapters`)
    unregister(name)    engine thread: new requests may no longer name it; the engine waits for its
                        running requests (`Adapter.refs`) before it reports the adapter gone

Invariants: a name is loaded at most once; at most `max_loaded` adapters are loaded; a refused adapter
(ValueError) changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prime_async.inference.lora import Adapter, RawAdapter, read_adapter
from prime_async.inference.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class AdapterRegistry:
    """Loads, registers and drops the LoRA adapters of one engine's runner."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_rank: int | None,
        target_modules: Iterable[str] | None,
        max_loaded: int,
    ):
        self.runner = runner
        self.max_rank = max_rank
        self.allowed = {m.rsplit(".", 1)[-1] for m in target_modules} if target_modules else None
        self.max_loaded = max_loaded

    def get(self, name: str) -> Adapter | None:
        return self.runner.adapters.get(name)

    def names(self) -> list[str]:
        return list(self.runner.adapters)

    async def read(self, name: str, path: str) -> RawAdapter:
        runner = self.runner
        return await asyncio.to_thread(
            read_adapter, name, path, num_layers=len(runner.layers), shapes=runner.linear_shapes(),
            max_rank=self.max_rank, allowed=self.allowed,
        )  # fmt: skip

    def register(self, raw: RawAdapter) -> list[str]:
        adapters = self.runner.adapters
        if raw.name in adapters:
            raise ValueError(f"The LoRA adapter with name {raw.name!r} is already loaded")
        if len(adapters) >= self.max_loaded:
            raise ValueError(
                f"{len(adapters)} LoRA adapters are loaded (max_loaded_loras = {self.max_loaded}): "
                "unload one first"
            )
        adapters[raw.name] = Adapter(raw=raw, layers=self.runner.fold_adapter(raw))
        logger.info("loaded LoRA adapter %s from %s (rank %d)", raw.name, raw.path, raw.rank)
        return list(adapters)

    def unregister(self, name: str) -> Adapter:
        adapter = self.runner.adapters.pop(name, None)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.runner.adapters)})")
        logger.info("unloaded LoRA adapter %s", name)
        return adapter
