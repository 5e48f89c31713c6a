"""Embedded inference engine: token ids in, token ids + logprobs + per-token weight versions out.

Called by `inference/server.py` (HTTP, SGLang shapes) from its asyncio loop; all model work happens in
one dedicated engine thread, so the event loop (and /health, /abort_request, ...) stays responsive.

    asyncio handlers ──submit──► inbox ──► waiting (FIFO) ──admit: prefill, ≤ max_prefill_tokens/step──►
        running slots 0..B-1 ──one batched decode step──► finished ──future.set_result──► handler
    commands (pause/continue/update/flush/abort) run on the engine thread between two steps.

Invariants:
- New requests join the running batch between decode steps (continuous batching); at most
  `max_running_requests` decode together, the rest wait in FIFO order.
- Every output token records the weight version live when it was sampled.
- pause `abort` ends running and waiting requests with finish `abort` and their partial output;
  `retract` moves running requests back to the head of the queue keeping their tokens (their KV is
  recomputed under the weights live at re-admission); `in_place` keeps their KV. While paused nothing
  is admitted or decoded.
- `update_weights` runs only while paused or with no running request (otherwise it waits for the running
  ones to finish and admits nothing meanwhile); invalid weights raise ValueError and change nothing.
- Every submitted request is resolved exactly once (result or exception), also on shutdown.
- A decode step runs through `ModelRunner.decode_rows`: padded to a batch bucket and replayed as a CUDA
  graph by default on CUDA (`decode_step`, `inference/static_decode.py`), eager for steps with LoRA rows.
- A request with images (`ImagePrompt`, vision-language models) runs its images through the vision tower
  at every prefill of it (a retracted request's re-prefill included; the tower's cache serves an image it
  already encoded under the same weights); its decode steps are those of any request.
- `deterministic`: one request runs at a time (prefill alone, then decode at batch size 1), so its tokens
  and logprobs never depend on other requests (batch invariance); with a `sampling_seed` they are a
  function of the prompt, the seed and the weights only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from prime_async.inference.engine_adapters import AdapterRegistry
from prime_async.inference.engine_settings import EngineSettings
from prime_async.inference.images import ImagePrompt
from prime_async.inference.lora import Adapter
from prime_async.inference.model_runner import ModelRunner
from prime_async.inference.sampler import SamplingParams, sample
from prime_async.types import EnginePauseMode

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one finished request produced; `versions[i]` is the weight version of `output_ids[i]`."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    finish_reason: dict[str, Any]
    latency_s: float
    weight_version: str
    routed_experts: torch.Tensor | None = None  # MoE, when asked: (positions, layers, k) of [0, kv_len)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None
    adapter: Adapter | None = None  # LoRA adapter named by the request (`lora_path`), None = base model
    images: ImagePrompt | None = None  # its images (`prompt` is then `images.ids`, placeholders expanded)
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    keep_routes: bool = False  # `return_routed_experts`: keep the experts of every position it ran through
    routes: list[torch.Tensor] = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        """Positions whose KV is cached once the last sampled token is pending as the next input."""
        return len(self.prompt) + len(self.output_ids) - 1


class _Defer(Exception):
    """A command that must wait until no request is running (update without pause)."""


class Engine:
    """Continuous-batching engine over a `ModelRunner`; all public methods are coroutine-safe. Built from
    one `EngineSettings` record (`engine_settings.py`); its LoRA adapters are an `AdapterRegistry`."""

    def __init__(self, settings: EngineSettings):
        s = settings
        device = s.device if s.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        self._num_threads = s.num_threads if device == "cpu" else None
        if self._num_threads:
            torch.set_num_threads(s.num_threads)
        self.runner = ModelRunner(
            model_path=s.model_path, dtype=s.dtype, device=device,
            num_slots=s.slots.max_running_requests, max_len=s.slots.max_len, chunk=s.slots.kv_cache_chunk,
            kernels=s.kernels, decode_step=s.slots.decode_step, decode_buckets=s.slots.decode_buckets,
        )  # fmt: skip
        self.settings = settings
        self.model_path = s.model_path
        self.max_len = s.slots.max_len
        self.max_prefill_tokens = s.slots.max_prefill_tokens
        self.vocab_size = self.runner.vocab_size
        eos = self.runner.text_config.eos_token_id
        gen_eos = getattr(getattr(self.runner.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {
            e for x in (eos, gen_eos) if x is not None for e in (x if isinstance(x, list) else [x])
        }
        self.weight_version = str(s.weight_version)
        self.deterministic = s.deterministic
        self.adapters = AdapterRegistry(
            self.runner, max_rank=s.lora.max_rank, target_modules=s.lora.target_modules,
            max_loaded=s.lora.max_loaded,
        )  # fmt: skip
        self.paused = False
        self._generator = torch.Generator(device=self.runner.device).manual_seed(s.seed)
        self._inbox: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future, Any]] = queue.SimpleQueue()
        self._deferred: list[tuple[Callable[[], Any], asyncio.Future, Any]] = []
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.num_generated_tokens = 0
        self.busy_s = 0.0  # engine-thread seconds in forward steps (`stats()`)
        self._started_at = time.monotonic()

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "engine thread did not stop"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- public API (asyncio side) -------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        lora: str | None = None,
        *,
        return_routed_experts: bool = False,
        images: ImagePrompt | None = None,
    ) -> RequestOutput:
        """Run one request; `lora` names a loaded adapter (ValueError if it is not loaded).
        `return_routed_experts` (MoE models): the output carries the experts of every position the model
        ran through (prompt and sampled tokens but the last), as SGLang's field of that name. `images`:
        the prompt's images (`input_ids` is then `images.ids`)."""
        loop = asyncio.get_running_loop()
        adapter = None
        if lora is not None:
            adapter = self.adapters.get(lora)
            if adapter is None:
                raise ValueError(f"The following requested LoRA adapters are not loaded: {lora}")
        gen = None
        if params.sampling_seed is not None:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.sampling_seed)
        req = _Request(
            rid or uuid.uuid4().hex, list(input_ids), params, loop.create_future(), loop, gen, adapter
        )
        req.keep_routes = return_routed_experts
        req.images = images
        if adapter is not None:
            adapter.refs += 1
        try:
            self._inbox.put(req)
            self._wake.set()
            return await req.future
        finally:
            if adapter is not None:
                adapter.refs -= 1

    async def score(
        self,
        prompts: list[list[int]],
        temperatures: list[float],
        images: list[ImagePrompt | None] | None = None,
    ) -> list[list[float | None]]:
        """Prefill-only scoring (SGLang's `max_new_tokens = 0` with `return_logprob`): per prompt, the
        logprob of each token given the ones before it, None for the first; one forward for all prompts,
        run between engine steps (running requests and their caches are untouched). `images[r]`: prompt
        r's images."""
        scored = await self._call(lambda: self.runner.score(prompts, temperatures, images))
        return [[None, *lps] for lps in scored]

    async def score_top(
        self,
        prompts: list[list[int]],
        temperatures: list[float],
        top_n: int,
        images: list[ImagePrompt | None] | None = None,
    ) -> list[tuple[list[float | None], list[list[tuple[float, int]] | None]]]:
        """`score`, with the `top_n` most likely (logprob, token id) of every position (None for the
        first), SGLang's `input_top_logprobs`."""
        scored = await self._call(lambda: self.runner.score_top(prompts, temperatures, top_n, images))
        return [([None, *lps], [None, *tops]) for lps, tops in scored]

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Read, validate and register adapter `name` (`engine_adapters.py`); returns the loaded names.
        ValueError on a bad adapter, a taken name or a full registry (nothing changes then)."""
        raw = await self.adapters.read(name, path)
        return await self._call(lambda: self.adapters.register(raw))

    async def unload_lora_adapter(self, name: str) -> list[str]:
        """New requests may no longer name `name` at once; it is dropped once its running requests end
        (as SGLang waits for them). Returns the names still loaded."""
        adapter = await self._call(lambda: self.adapters.unregister(name))
        while adapter.refs > 0:
            await asyncio.sleep(0.02)
        return self.adapters.names()

    async def pause(self, mode: EnginePauseMode) -> None:
        await self._call(lambda: self._pause(mode))

    async def resume(self) -> None:
        await self._call(self._resume)

    async def update_weights(
        self, model_path: str, version: str | None, *, flush_cache: bool, abort_all: bool
    ) -> tuple[bool, str, int]:
        """-> (success, message, num_paused_requests). Raises ValueError on invalid weights."""
        if abort_all:
            await self.abort(None, abort_all=True)
        return await self._call(lambda: self._update(model_path, version, flush_cache))

    async def load_tensors(
        self, state: dict[str, torch.Tensor], version: str | None, *, flush_cache: bool, source: str,
        partial: bool = True,
    ) -> tuple[bool, str, int]:  # fmt: skip
        """Copy weights, as `update_weights` does from disk: only while paused or idle, ValueError on
        invalid tensors (nothing changed). `partial`: a subset (one bucket of a distributed update);
        otherwise every expected tensor must be there (a shared-memory version)."""
        return await self._call(lambda: self._update_from(state, source, version, flush_cache, partial))

    async def set_weight_version(self, version: str) -> None:
        """Relabel the served version (SGLang `/update_weight_version`): tokens sampled from now carry it."""

        def relabel() -> None:
            self.weight_version = str(version)

        await self._call(relabel)

    async def flush_cache(self) -> bool:
        return await self._call(self._flush)

    async def abort(self, rid: str | None, *, abort_all: bool = False) -> None:
        await self._call(lambda: self._abort(rid, abort_all))

    def stats(self) -> dict[str, Any]:
        """Queue lengths, tokens generated, and `busy_s`: seconds the engine thread spent in forward steps
        (prefill or decode) since start; with `uptime_s`, the fraction of time the engine was busy.
        Vision-language models: `vision_s` (seconds in the vision tower, part of `busy_s`),
        `images_encoded`, `image_cache_hits`."""
        vision = self.runner.vision
        extra = {} if vision is None else {
            "vision_s": vision.seconds, "images_encoded": vision.images_encoded,
            "image_cache_hits": vision.cache_hits,
        }  # fmt: skip
        return {
            **extra,
            "busy_s": self.busy_s,
            "uptime_s": time.monotonic() - self._started_at,
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting) + self._inbox.qsize(),
            "num_generated_tokens": self.num_generated_tokens,
            "paused": self.paused,
        }

    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put((fn, fut, loop))
        self._wake.set()
        return await fut

    # ---- engine thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self._num_threads:  # OpenMP's thread count is per thread: set it where the model runs
            torch.set_num_threads(self._num_threads)
        while not self._stop:
            self._wake.clear()
            try:
                self._drain_inbox()
                self._run_commands()
                can_admit = bool(self._waiting) and not self.paused and not self._deferred
                can_decode = bool(self._running) and not self.paused
                if not (can_admit or can_decode):
                    self._wake.wait(timeout=1.0)
                    continue
                t0 = time.monotonic()
                if can_admit:
                    self._admit()
                if self._running:
                    self._decode_step()
                self.busy_s += time.monotonic() - t0
            except Exception as exc:  # tolerated: fail the affected requests, keep serving others
                logger.exception("engine step failed; failing %d running requests", len(self._running))
                for req in self._running:
                    self._reject(req, RuntimeError(f"engine step failed: {exc}"))
                self._running.clear()
        self._shutdown()

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _run_commands(self) -> None:
        pending, self._deferred = self._deferred, []
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for fn, fut, loop in pending:
            try:
                result = fn()
            except _Defer:
                self._deferred.append((fn, fut, loop))
                continue
            except Exception as exc:  # delivered to the caller (HTTP 4xx/5xx), engine keeps serving
                loop.call_soon_threadsafe(_set_exception, fut, exc)
                continue
            loop.call_soon_threadsafe(_set_result, fut, result)

    def _admit(self) -> None:
        """Move waiting requests (FIFO, within the prefill token budget) into free slots, prefilling them
        together; a fresh request samples its first token from its prefill logits."""
        budget = self.max_prefill_tokens
        batch: list[_Request] = []
        prompts: list[list[int]] = []
        slots = 1 if self.deterministic else self.runner.num_slots
        while self._waiting and len(self._running) + len(batch) < slots:
            req = self._waiting[0]
            tokens = req.prompt + req.output_ids[:-1] if req.output_ids else req.prompt
            if batch and len(tokens) > budget:
                break
            batch.append(self._waiting.popleft())
            prompts.append(tokens)
            budget -= len(tokens)
        if not batch:
            return
        first = len(self._running)
        self._running.extend(batch)  # before the forward: a failing step fails them with the others
        adapters = [r.adapter for r in batch]
        images = [r.images for r in batch]
        logits = self.runner.prefill(prompts, list(range(first, first + len(batch))), adapters, images)
        routes = self.runner.take_routes() if any(r.keep_routes for r in batch) else None
        if routes is not None:  # a (re-)prefill recomputes every position's routing: it replaces the old
            for req, part in zip(batch, routes.split([len(p) for p in prompts]), strict=True):
                req.routes = [part] if req.keep_routes else []
        fresh = [j for j, req in enumerate(batch) if not req.output_ids]
        if fresh:
            self._append_tokens([batch[j] for j in fresh], logits[fresh])
        self._remove_finished()

    def _decode_step(self) -> None:
        positions = [r.kv_len for r in self._running]
        ids = [r.output_ids[-1] for r in self._running]
        logits = self.runner.decode_rows(ids, positions, [r.adapter for r in self._running])
        routes = self.runner.take_routes() if any(r.keep_routes for r in self._running) else None
        if routes is not None:
            for b, req in enumerate(self._running):
                if req.keep_routes:
                    req.routes.append(routes[b : b + 1])
        self._append_tokens(self._running, logits)
        self._remove_finished()

    def _append_tokens(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(
            logits, [r.params for r in reqs], [r.generator for r in reqs], self._generator
        )
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(self.weight_version)
        self.num_generated_tokens += len(reqs)

    def _finish_reason(self, req: _Request) -> dict[str, Any] | None:
        tok = req.output_ids[-1]
        if tok in req.params.stop_token_ids or (not req.params.ignore_eos and tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= req.params.max_new_tokens or req.kv_len + 1 >= self.max_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _remove_finished(self) -> None:
        # walk backwards so that compaction (last slot moves into the hole) never skips a request
        for idx in range(len(self._running) - 1, -1, -1):
            req = self._running[idx]
            reason = self._finish_reason(req)
            if reason is not None:
                self._remove_slot(idx)
                self._resolve(req, reason)

    def _remove_slot(self, idx: int) -> None:
        last = len(self._running) - 1
        if idx != last:
            moved = self._running[last]
            self.runner.move_slot(last, idx, moved.kv_len)
            self._running[idx] = moved
        self._running.pop()

    def _resolve(self, req: _Request, reason: dict[str, Any]) -> None:
        out = RequestOutput(
            rid=req.rid, prompt_tokens=len(req.prompt), output_ids=req.output_ids, logprobs=req.logprobs,
            versions=req.versions, finish_reason=reason, latency_s=time.monotonic() - req.created,
            weight_version=self.weight_version,
            routed_experts=torch.cat(req.routes).cpu() if req.routes else None,
        )  # fmt: skip
        req.loop.call_soon_threadsafe(_set_result, req.future, out)

    def _reject(self, req: _Request, exc: Exception) -> None:
        req.loop.call_soon_threadsafe(_set_exception, req.future, exc)

    # ---- commands (engine thread) --------------------------------------------------------------------
    def _pause(self, mode: str) -> None:
        self.paused = True
        if mode == "abort":
            self._abort(None, abort_all=True)
        elif mode == "retract":
            # running requests go back to the head of the queue in their original order, tokens kept
            self._waiting.extendleft(reversed(self._running))
            self._running.clear()
        else:
            assert mode == "in_place", f"unknown pause mode {mode}"
        logger.info("generation paused (mode=%s)", mode)

    def _resume(self) -> None:
        self.paused = False
        logger.info("generation continued")

    def _update(self, model_path: str, version: str | None, flush_cache: bool) -> tuple[bool, str, int]:
        if self._running and not self.paused:
            raise _Defer
        num_params = self.runner.load_weights(model_path)
        return self._after_load(f"{num_params} tensors from {model_path}", version, flush_cache)

    def _update_from(
        self, state: dict[str, torch.Tensor], source: str, version: str | None, flush_cache: bool,
        partial: bool = True,
    ) -> tuple[bool, str, int]:  # fmt: skip
        if self._running and not self.paused:
            raise _Defer
        num = self.runner.load_state(state, source=source, partial=partial)
        return self._after_load(f"{num} tensors from {source}", version, flush_cache)

    def _after_load(self, what: str, version: str | None, flush_cache: bool) -> tuple[bool, str, int]:
        if version is not None:
            self.weight_version = str(version)
        logger.info("loaded %s as version %s", what, self.weight_version)
        num_paused = len(self._running) + len(self._waiting)
        if flush_cache and not self._flush():
            return (
                False,
                f"weights updated to version {self.weight_version}, but the cache was not flushed: "
                f"{len(self._running)} paused requests hold KV cache (send flush_cache=false with in_place)",
                num_paused,
            )
        return True, "Succeeded to update model weights.", num_paused

    def _flush(self) -> bool:
        """Drop cached KV; refused while any request holds KV (SGLang refuses with pending requests)."""
        if self._running:
            return False
        self.runner.free_cache()
        return True

    def _abort(self, rid: str | None, abort_all: bool) -> None:
        self._drain_inbox()
        for idx in range(len(self._running) - 1, -1, -1):
            req = self._running[idx]
            if abort_all or req.rid == rid:
                self._remove_slot(idx)
                self._resolve(req, {"type": "abort", "message": "Abort in-flight request."})
        keep: deque[_Request] = deque()
        for req in self._waiting:
            if abort_all or req.rid == rid:
                self._resolve(req, {"type": "abort", "message": "Abort before running."})
            else:
                keep.append(req)
        self._waiting = keep

    def _shutdown(self) -> None:
        self._drain_inbox()
        self._abort(None, abort_all=True)
        for _, fut, loop in [*self._deferred, *_drain(self._commands)]:
            loop.call_soon_threadsafe(_set_exception, fut, RuntimeError("engine stopped"))


def _drain(q: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
