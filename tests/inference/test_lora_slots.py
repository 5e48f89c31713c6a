"""LoRA adapter slots where LoRA meets K: with the slots `rl` derives from K, every update finds a free
slot while requests of every still-shippable version keep running (they keep their adapter through
pauses), and an engine with too few slots refuses the load as SGLang does.

The inner client is a hand-written fake of an engine's adapter registry (load refused when full, unload
waits for nothing: the requests are modelled by the client's own in-flight counts)."""

from __future__ import annotations

import asyncio

import pytest

from prime_async.config.interactions import lora_slots_needed
from prime_async.engine_api import GenerateResult
from prime_async.inference.client import EngineError
from prime_async.weights.lora_client import LoraEngineClient, adapter_name


class SlotEngine:
    """Adapter registry with `max_loaded_loras` slots; generate blocks until its version is released."""

    base_url = "fake://slots"

    def __init__(self, max_loaded: int) -> None:
        self.max_loaded = max_loaded
        self.loaded: list[str] = []
        self.version = 0
        self.release: dict[int, asyncio.Event] = {}
        self.peak = 0

    async def weight_version(self) -> int:
        return self.version

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        if len(self.loaded) >= self.max_loaded:
            raise EngineError(400, "/load_lora_adapter", f"{len(self.loaded)} LoRA adapters are loaded")
        self.loaded.append(name)
        self.peak = max(self.peak, len(self.loaded))
        return list(self.loaded)

    async def unload_lora_adapter(self, name: str) -> dict[str, str]:
        self.loaded.remove(name)
        return {}

    async def update_weight_version(self, version: int) -> None:
        self.version = version

    async def generate(
        self, input_ids, sampling_params, rid=None, lora_path=None, image_data=None
    ) -> GenerateResult:
        version = int(lora_path[1:]) if lora_path else 0
        await self.release.setdefault(version, asyncio.Event()).wait()
        return GenerateResult(rid or "", [1], [-0.1], [version], "stop", len(input_ids), version)


def run_updates(k: int, slots: int, updates: int) -> SlotEngine:
    """Versions 1..updates load one by one; after loading v, one request starts at v and runs until
    version v + k loads (the last moment its group can still ship), as a long generation under K."""

    async def main() -> SlotEngine:
        engine = SlotEngine(slots)
        client = LoraEngineClient(engine)  # type: ignore[arg-type]
        running = [asyncio.create_task(client.generate([5], {}))]  # starts at v0 (base model)
        await asyncio.sleep(0)
        for version in range(1, updates + 1):
            engine.release.setdefault(version - k - 1, asyncio.Event()).set()  # unshippable: cancelled
            await asyncio.sleep(0)
            await client.update_weights_from_disk(f"/b/step_{version}", version, flush_cache=False)
            running.append(asyncio.create_task(client.generate([5], {})))
            await asyncio.sleep(0)
        for event in list(engine.release.values()):
            event.set()
        await asyncio.gather(*running)
        return engine

    return asyncio.run(main())


@pytest.mark.parametrize("k", [1, 3, 8])
def test_derived_slots_suffice_with_requests_of_every_shippable_version(k: int) -> None:
    engine = run_updates(k, slots=lora_slots_needed(k, 1), updates=3 * k + 4)
    assert engine.peak <= lora_slots_needed(k, 1)
    assert adapter_name(3 * k + 4) in engine.loaded


def test_the_old_default_of_four_slots_fills_up_at_k_8() -> None:
    """What ended LoRA runs at the default K = 8: the fifth adapter in use is refused."""
    with pytest.raises(EngineError, match="LoRA adapters are loaded"):
        run_updates(8, slots=4, updates=12)
