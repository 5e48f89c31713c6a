"""`EngineClient` of a LoRA run: weight updates load adapters, requests name the adapter of their version.

    update_weights_from_disk(broadcasts/step_N, N)  ──►  /load_lora_adapter {"lora_name": "vN", "lora_path"}
                                                         /update_weight_version {"new_version": N}
                                                         /unload_lora_adapter of older idle adapters
    generate(...)  ──►  /generate {..., "lora_path": "vN"}   (N = version served when the request starts;
                                                               v0 = the base model, no adapter)

Used by the orchestrator (`orchestrator.py`, in-run eval) when `lora` is set; wraps an `HttpEngineClient`,
so it drives real SGLang (launched with `--enable-lora`) and the embedded engine alike. The request side
(which adapter a request names) is this client's; the load side is `weights/loaders/lora.py`'s
`LoraLoader`, which calls `load_adapter` (`update_weights_from_disk` is the same load, for callers that
hold only the `EngineClient` protocol). The weight watcher's protocol (cancel, pause, load, resume, flush
after `in_place`) is unchanged.

Invariants:
- a request runs start to end with the adapter it named (SGLang fixes a request's adapter when it is
  created, retract and in_place pauses included), so every token of it was sampled by that adapter's
  version: the result's per-token versions and `weight_version` are that version, whatever the engine's
  global label says meanwhile. Staleness therefore stays exact: d <= the version of each token;
- an adapter is unloaded only when no request of this client runs with it and it is not the current
  one (before a load, to free its slot, and after); the engine itself also waits for running requests
  before it drops an adapter (as SGLang does);
- with `max_loaded_loras >= K // weights.update_interval + 2` (what `rl` derives, `config/interactions.py`)
  a load always finds a free slot: running requests name at most K // interval + 1 versions;
- no flush on load: adapters have their own prefix-cache namespace in SGLang and the embedded engine has
  no prefix cache; the watcher's flush after `in_place` still passes through.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Protocol

from prime_async.engine_api import EngineClient, GenerateResult
from prime_async.types import EnginePauseMode

logger = logging.getLogger(__name__)


class WrappedEngine(EngineClient, Protocol):
    """The engine client a `LoraEngineClient` wraps (`inference/client.py`'s `HttpEngineClient`)."""

    async def model_info(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


def adapter_name(version: int) -> str:
    """The engine-side name of the adapter of weights version `version` (>= 1)."""
    return f"v{version}"


class LoraEngineClient:
    """One engine serving a base model plus per-version LoRA adapters."""

    def __init__(self, inner: WrappedEngine):
        self.inner = inner
        self.base_url = inner.base_url
        self._current: int | None = None  # version new requests run at; None: ask the engine first
        self._inflight: collections.Counter[int] = collections.Counter()
        self._loaded: set[int] = set()

    async def _version(self) -> int:
        if self._current is None:
            self._current = await self.inner.weight_version()
            if self._current > 0:  # an engine that already serves an adapter of this run (resume)
                self._loaded.add(self._current)
        return self._current

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None,
        *, image_data: list[str] | None = None,
    ) -> GenerateResult:  # fmt: skip
        version = await self._version()
        lora = adapter_name(version) if version > 0 else None
        self._inflight[version] += 1
        try:
            result = await self.inner.generate(
                input_ids, sampling_params, rid, lora_path=lora, image_data=image_data
            )
        finally:
            self._inflight[version] -= 1
        result.token_versions = [version] * len(result.output_ids)
        result.weight_version = version
        return result

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, *, flush_cache: bool, abort_all_requests: bool = False
    ) -> None:
        """`load_adapter` (no flush: adapters have their own prefix-cache namespace)."""
        if abort_all_requests:
            await self.inner.abort_request(abort_all=True)
        await self.load_adapter(model_path, weight_version)

    async def load_adapter(self, model_path: str, weight_version: int) -> None:
        """Load `model_path` (a PEFT adapter directory) as the adapter of `weight_version`, make it the
        one new requests name, then unload older adapters no request of ours runs with. Idle adapters
        are unloaded before the load too, so the new one finds a free slot whenever one can be free."""
        current = await self._version()
        await self._unload_idle(keep={current, weight_version})
        name = adapter_name(weight_version)
        await self.inner.load_lora_adapter(name, str(model_path))
        self._loaded.add(weight_version)
        await self.inner.update_weight_version(weight_version)
        self._current = weight_version
        await self._unload_idle(keep={weight_version})
        logger.debug("engine %s: adapter %s loaded (%s)", self.base_url, name, model_path)

    async def _unload_idle(self, *, keep: set[int]) -> None:
        for old in sorted(self._loaded - keep):
            if self._inflight[old] == 0:
                await self.inner.unload_lora_adapter(adapter_name(old))
                self._loaded.discard(old)

    async def pause_generation(self, mode: EnginePauseMode) -> None:
        await self.inner.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.inner.continue_generation()

    async def flush_cache(self) -> None:
        await self.inner.flush_cache()

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        await self.inner.abort_request(rid, abort_all=abort_all)

    async def weight_version(self) -> int:
        return await self.inner.weight_version()

    async def model_info(self) -> dict[str, Any]:
        return await self.inner.model_info()

    async def server_info(self) -> dict[str, Any]:
        return await self.inner.server_info()

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()
