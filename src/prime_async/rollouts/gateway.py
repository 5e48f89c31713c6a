"""Token-in/token-out gateway: serves vLLM's `POST /inference/v1/generate` for verifiers' train client and
forwards each call to SGLang's native `/generate` on one engine (through `EngineClient.generate`).

    verifiers TrainClient ──POST {base}/inference/v1/generate {"model": <episode key>, "token_ids", ...}──►
    Gateway ── route by the `model` field to the episode's engine (sticky) ──► EngineClient.generate
            ◄── vLLM-shaped answer (choices[0].token_ids / logprobs.content / finish_reason) ──┘
            └── records (prompt_ids, output_ids, logprobs, versions) on the episode's session

Who calls it: `rollouts/verifiers_source.py` opens one `GatewaySession` per episode and hands its `key` to
verifiers as the model name; `close_session` forgets it.

Invariants:
- every call of one session goes to the same engine (sticky routing by the session's `engine_key`);
- each answer's `logprobs.content` has exactly one entry per returned token, `token == "token_id:<id>"`;
- a session's `calls` are recorded in completion order with the per-token versions the engine reported;
- prompt + completion never exceed `seq_len`: `max_tokens` is clamped, and a prompt that already fills
  `seq_len` is answered with zero tokens and `finish_reason="length"` (the session is marked truncated);
- a session whose sampling has a `seed` sends its k-th call (k = 0, 1, ... in issue order) with
  `sampling_seed = call_seed(seed, k)`, overriding any seed of the request (deterministic runs);
- a call an engine outage failed (EngineUnavailable: refused, reset, the engine killed) is reported to
  the gate; when the gate retries outages (a weight watcher ends them, `request_gate.py`) it is held until
  the engines are back and sent again with the same prompt and sampling (the same `sampling_seed`), under
  the outage's deadline; the failed attempt's partial output is discarded, so a session records one call
  per answered request, as without the outage;
- a cancelled session's in-flight requests are aborted on its engine and later calls are refused (409);
- a session opened with `replay` (calls recorded in an earlier lifetime, `rollouts/replay.py`) answers a
  request whose prompt ids equal a recorded call's from that record, and continues a recorded partial
  call on the engine; the call recorded on the session is always the whole one (kept + new tokens);
- `freeze()` (a planned stop): no call is forwarded any more, in-flight engine requests are aborted and
  their partial output recorded, and no answer reaches the environment after that (the env must not
  move on: the recorded calls are what the next lifetime replays);
- a prompt with images (`content_parts`, `rollouts/images.py`) is expanded by the model's image processor:
  the engine gets the unexpanded ids with `image_data` (as SGLang takes them), the call is recorded with
  the expanded ids and the images' placement, and the answer carries `prompt_token_ids` and
  `mm_placeholders`; a bad image is a 400 naming it, and an expanded prompt longer than `seq_len` a 400
  naming its token count (never sent);
- session keys are recycled, oldest first, only once more than `KEY_QUARANTINE` keys are free: verifiers'
  renderers client caches one entry per (endpoint, model), so fresh keys per episode would grow that cache
  forever, while a key is reused only long after its episode ended (a straggler request of a closed
  episode cannot reach the next owner of its key in practice).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import socket
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prime_async.engine_api import EngineClient, EngineUnavailable, GenerateResult, SamplingParams
from prime_async.rollouts import replay as replays
from prime_async.rollouts.images import ImageError, ImagePlacer, ImagePrompt, image_urls
from prime_async.rollouts.seeds import call_seed
from prime_async.weights.request_gate import RequestGate

logger = logging.getLogger(__name__)

GENERATE_ROUTE = "/inference/v1/generate"
KEY_QUARANTINE = 256
# vLLM sampling keys verifiers/renderers send that SGLang's `/generate` knows under another name or
# not at all (`logprobs`: SGLang takes `return_logprob` at the request level, which we always set).
_RENAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
_DROPPED = {"logprobs", "prompt_logprobs", "n", "seed_offset"}
_SGLANG_KEYS = {
    "temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop", "stop_token_ids",
    "skip_special_tokens", "spaces_between_special_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_new_tokens", "ignore_eos", "no_stop_trim", "seed", "sampling_seed",
}  # fmt: skip


@dataclass
class GatewayCall:
    """One completed generate call of an episode."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    finish_type: str
    weight_version: int
    routed_experts: Any = None  # flat int32 numpy (SGLang's layout) when the engine was asked for them
    images: ImagePrompt | None = None  # the prompt's images and their placement (None: text only)


@dataclass
class GatewaySession:
    """Per-episode routing + recording state. `key` is what verifiers sends as the `model` field."""

    key: str
    engine_index: int
    sampling: SamplingParams | None
    calls: list[GatewayCall] = field(default_factory=list)
    inflight: set[str] = field(default_factory=set)
    truncated: bool = False
    aborted: bool = False
    cancelled: bool = False
    num_errors: int = 0
    num_issued: int = 0
    engine_key: str = ""
    replay: list[GatewayCall] = field(default_factory=list)


def to_sglang_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """vLLM/OpenAI-style sampling params -> SGLang `sampling_params` (unknown keys are dropped)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        key = _RENAMES.get(key, key)
        if key in _DROPPED or value is None:
            continue
        if key in _SGLANG_KEYS:
            out[key] = value
    return out


def vllm_response(result: GenerateResult, rid: str) -> dict[str, Any]:
    """The vLLM `/inference/v1/generate` answer verifiers' renderers client parses."""
    finish = result.finish_type if result.finish_type in ("stop", "length") else "abort"
    return {
        "request_id": rid,
        "choices": [
            {
                "index": 0,
                "token_ids": result.output_ids,
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{tid}", "logprob": lp}
                        for tid, lp in zip(result.output_ids, result.output_logprobs, strict=True)
                    ]
                },
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.output_ids),
            "total_tokens": result.prompt_tokens + len(result.output_ids),
        },
    }


OUTAGE_RETRIES = 3  # times one call is sent again after an engine outage failed it
CANCEL_PARTIAL_TIMEOUT_S = 2.0  # how long a cancel waits for an aborted request's partial output


class GatewayError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Gateway:
    """HTTP gateway on 127.0.0.1 (free port by default) in front of a list of engines."""

    def __init__(
        self,
        *,
        engines: list[EngineClient],
        seq_len: int,
        host: str = "127.0.0.1",
        port: int = 0,
        gate: RequestGate | None = None,
        images: ImagePlacer | None = None,
    ) -> None:
        if not engines:
            raise ValueError("gateway needs at least one engine")
        self.engines = engines
        self.seq_len = seq_len
        self.images = images  # places a prompt's images (a VLM); None: prompts with images are refused
        self._expansion_warned = False
        self.host = host
        self.port = port
        self.sessions: dict[str, GatewaySession] = {}
        self._ids = itertools.count()
        self._keys = itertools.count()
        self._free_keys: collections.deque[str] = collections.deque()
        self._server: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self.num_requests = 0
        self.num_outage_retries = 0  # calls held and sent again after an engine outage (cumulative)
        self.num_model_list_requests = 0  # GET /v1/models (renderers' prompt-limit lookup)
        self.last_answer: dict[str, float] = {}  # engine URL -> time.monotonic() of its last answer
        # The run's one gate in front of these engines (weights/request_gate.py): closed by the weight
        # watcher between an in_place update and the cache flush; engine outages are reported to it.
        self.gate = gate if gate is not None else RequestGate()
        self.replay_stats = replays.ReplayStats()
        self._frozen = asyncio.Event()
        self._released = asyncio.Event()
        self._at_engine: set[str] = set()  # rids sent to an engine and not answered yet

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- sessions -------------------------------------------------------------------------------

    def engine_for(self, engine_key: str) -> int:
        """Sticky engine choice: an engine's index or base_url picks it, anything else hashes."""
        for i, engine in enumerate(self.engines):
            if engine_key == engine.base_url:
                return i
        if engine_key.isdigit() and int(engine_key) < len(self.engines):
            return int(engine_key)
        return zlib.crc32(engine_key.encode()) % len(self.engines)

    def open_session(
        self,
        *,
        engine_key: str,
        sampling: SamplingParams | None = None,
        replay: list[GatewayCall] | None = None,
    ) -> GatewaySession:
        recycle = len(self._free_keys) > KEY_QUARANTINE
        key = self._free_keys.popleft() if recycle else f"ep-{next(self._keys)}"
        session = GatewaySession(
            key=key, engine_index=self.engine_for(engine_key), sampling=sampling, engine_key=engine_key,
            replay=list(replay or ()),
        )  # fmt: skip
        self.sessions[key] = session
        return session

    def close_session(self, key: str) -> None:
        if self.sessions.pop(key, None) is not None:
            self._free_keys.append(key)

    async def cancel_session(self, key: str, *, partial_timeout_s: float = CANCEL_PARTIAL_TIMEOUT_S) -> int:
        """Refuse further calls of the session and abort its in-flight engine requests; wait (at most
        `partial_timeout_s`) for their partial outputs to be recorded. The tokens the episode sampled."""
        session = self.sessions.get(key)
        if session is None:
            return 0
        session.cancelled = True
        engine = self.engines[session.engine_index]
        aborted = [rid for rid in list(session.inflight) if rid in self._at_engine]
        for rid in list(session.inflight):
            try:
                await engine.abort_request(rid)
            except Exception:  # tolerated: the request may have finished or the engine be gone
                logger.warning("abort of %s on %s failed", rid, engine.base_url, exc_info=True)
        deadline = time.monotonic() + partial_timeout_s
        while any(rid in session.inflight for rid in aborted) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return sum(len(call.output_ids) for call in session.calls)

    # --- the route --------------------------------------------------------------------------------

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Handle one `/inference/v1/generate` body; raises GatewayError for client errors."""
        session = self.sessions.get(str(body.get("model")))
        if session is None:
            raise GatewayError(404, f"unknown episode key (model) {body.get('model')!r}")
        if session.cancelled:
            raise GatewayError(409, f"episode {session.key} was cancelled")
        prompt_ids = body.get("token_ids")
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
            raise GatewayError(400, "token_ids must be a list of ints")
        prompt_ids, images = self._place_images(prompt_ids, body.get("content_parts"))
        sampling = to_sglang_sampling(dict(body.get("sampling_params") or {}))
        if session.sampling is not None:  # the episode's settings override the request's
            sampling.update(session.sampling.to_sglang())
            if session.sampling.seed is not None:
                sampling.pop("seed", None)
                sampling["sampling_seed"] = call_seed(session.sampling.seed, session.num_issued)
        session.num_issued += 1
        budget = self.seq_len - len(prompt_ids)
        requested = sampling.get("max_new_tokens")
        max_new = budget if requested is None else min(int(requested), budget)
        rid = f"{session.key}-{len(session.calls)}-{next(self._ids)}"
        self.num_requests += 1
        if max_new <= 0:
            session.truncated = True
            empty = GenerateResult(rid, [], [], [], "length", len(prompt_ids), -1)
            return vllm_response(empty, rid)
        sampling["max_new_tokens"] = max_new
        if session.replay:
            result = await self._replay(session, prompt_ids, sampling, rid, images)
        else:
            result = await self._call_engine(session, prompt_ids, sampling, rid, images=images)
        if self._frozen.is_set():  # recorded for the next lifetime; the environment must not move on
            await self._stopped()
        answer = vllm_response(result, rid)
        if images is not None:  # what verifiers projects the renderer's prompt onto
            answer.update(prompt_token_ids=prompt_ids, mm_placeholders=images.images.placeholders())
        return answer

    def _place_images(self, prompt_ids: list[int], parts: Any) -> tuple[list[int], ImagePrompt | None]:
        """(the ids the call records, its images): the expanded prompt of a call with images (module
        docstring), the ids as given without."""
        if not parts:
            return prompt_ids, None
        if self.images is None:
            raise GatewayError(400, "the prompt has images but the model is not a vision-language model")
        try:
            expanded, placed = self.images.place(prompt_ids, image_urls(parts))
        except ImageError as e:
            raise GatewayError(400, str(e)) from e
        if len(expanded) > self.seq_len:
            image_tokens = sum(n for _, n in placed.spans)
            count = len(placed.spans)
            raise GatewayError(400, f"Prompt length ({len(expanded)}) exceeds maximum context length "
                               f"({self.seq_len}): {image_tokens} of its tokens come from its {count} "
                               f"image{'s' if count != 1 else ''}")  # fmt: skip
        return expanded, ImagePrompt(engine_ids=list(prompt_ids), images=placed)

    async def _replay(
        self, session: GatewaySession, prompt_ids: list[int], sampling: dict[str, Any], rid: str,
        images: ImagePrompt | None = None,
    ) -> GenerateResult:  # fmt: skip
        """Answer from the session's record (module docstring), or call the engine when there is none."""
        stats, call = self.replay_stats, replays.take_recorded(session.replay, prompt_ids)
        if call is None:
            stats.misses += 1
            logger.info("episode %s: no recorded call of this prompt: generated afresh", session.engine_key)
            return await self._call_engine(session, prompt_ids, sampling, rid, images=images)
        if not replays.is_partial(call):
            stats.count_replayed(len(call.output_ids))
            self._mark_ending(session, prompt_ids, call.finish_type, len(call.output_ids))
            session.calls.append(call)
            return replays.recorded_result(call, rid)
        kept = len(call.output_ids)
        sampling["max_new_tokens"] -= kept
        stats.count_continued(kept)
        if sampling["max_new_tokens"] <= 0:  # the budget was used up exactly when it was cut
            done = dataclasses.replace(call, finish_type="length")
            self._mark_ending(session, prompt_ids, done.finish_type, len(done.output_ids))
            session.calls.append(done)
            return replays.recorded_result(done, rid)
        more = await self._call_engine(
            session, [*prompt_ids, *call.output_ids], sampling, rid, record=False,
            images=images.extended(call.output_ids) if images is not None else None,
        )  # fmt: skip
        result = replays.continued_result(call, more)
        self._record(session, prompt_ids, result, images)
        return result

    async def _call_engine(
        self, session: GatewaySession, prompt_ids: list[int], sampling: dict[str, Any], rid: str,
        *, record: bool = True, images: ImagePrompt | None = None,
    ) -> GenerateResult:  # fmt: skip
        """One model call on the session's engine. A call an engine outage failed (EngineUnavailable) is
        reported to the gate and, when the gate retries outages, held until the engines are back and sent
        again with the same prompt and sampling (same `sampling_seed`), at most `OUTAGE_RETRIES` times
        and within the outage's deadline; the failed attempt's partial output is discarded (never
        recorded)."""
        engine = self.engines[session.engine_index]
        for attempt in range(OUTAGE_RETRIES + 1):
            try:
                result = await self._send(
                    session, prompt_ids, sampling, rid if attempt == 0 else f"{rid}-r{attempt}", images
                )
                break
            except GatewayError:
                raise
            except EngineUnavailable as e:
                self.gate.engine_failed(e)
                if not self.gate.retries_outages or attempt == OUTAGE_RETRIES or session.cancelled:
                    session.num_errors += 1
                    raise GatewayError(
                        502, f"engine {engine.base_url} failed: {type(e).__name__}: {e}"
                    ) from e
                await self._wait_engines(session, engine, e)
            except Exception as e:
                session.num_errors += 1
                raise GatewayError(502, f"engine {engine.base_url} failed: {type(e).__name__}: {e}") from e
        self.last_answer[engine.base_url] = time.monotonic()
        bad = [lp for lp in result.output_logprobs if not math.isfinite(lp)]
        if len(result.output_logprobs) != len(result.output_ids) or bad:
            session.num_errors += 1
            raise GatewayError(502, f"engine {engine.base_url} returned misaligned or non-finite logprobs")
        if images is not None:
            self._check_expansion(engine.base_url, len(prompt_ids), result.prompt_tokens)
        if record:
            self._record(session, prompt_ids, result, images)
        return result

    def _check_expansion(self, url: str, expanded: int, counted: int) -> None:
        """Warn once when an engine counts an image prompt's tokens otherwise than the gateway expanded it
        (another image processor: its logprobs would not be the trainer's)."""
        if counted in (0, expanded) or self._expansion_warned:
            return
        self._expansion_warned = True
        logger.warning("engine %s counts %d prompt tokens for an image prompt the gateway expanded to %d: "
                       "its image processor differs from the model's", url, counted, expanded)  # fmt: skip

    async def _wait_engines(self, session: GatewaySession, engine: EngineClient, error: Exception) -> None:
        """Hold a call an outage failed until the gate says the engines are back (its deadline)."""
        self.num_outage_retries += 1
        logger.info("episode %s: model call failed by an outage of %s (%s): retried once the engines are "
                    "back", session.engine_key, engine.base_url, error)  # fmt: skip
        try:
            await self.gate.wait_engines(f"episode {session.engine_key}'s model call")
        except EngineUnavailable as e:
            session.num_errors += 1
            raise GatewayError(502, f"engine {engine.base_url} failed: {e}") from e

    async def _send(
        self, session: GatewaySession, prompt_ids: list[int], sampling: dict[str, Any], rid: str,
        images: ImagePrompt | None = None,
    ) -> GenerateResult:  # fmt: skip
        """Send one request through the gate; `rid` is in `session.inflight` while it runs. A prompt
        with images goes as its unexpanded ids with `image_data`."""
        engine = self.engines[session.engine_index]
        session.inflight.add(rid)
        try:
            async with self.gate.request():
                if session.cancelled:  # cancelled while held at the gate
                    raise GatewayError(409, f"episode {session.key} was cancelled")
                if self._frozen.is_set():
                    await self._stopped()  # a planned stop: nothing new reaches an engine
                self._at_engine.add(rid)
                try:
                    if images is None:
                        return await engine.generate(prompt_ids, sampling, rid=rid)
                    return await engine.generate(
                        images.engine_ids, sampling, rid=rid, image_data=images.images.urls
                    )
                finally:
                    self._at_engine.discard(rid)
        finally:
            session.inflight.discard(rid)

    def _mark_ending(self, session: GatewaySession, prompt_ids: list[int], finish: str, n_out: int) -> None:
        """What a call's end says about its episode, the same for a sampled call and a replayed one: an
        abort marks it aborted, a `length` finish that filled `seq_len` marks it truncated (overlong)."""
        if finish == "abort":
            session.aborted = True
        if finish == "length" and len(prompt_ids) + n_out >= self.seq_len:
            session.truncated = True

    def _record(
        self, session: GatewaySession, prompt_ids: list[int], result: GenerateResult,
        images: ImagePrompt | None = None,
    ) -> None:  # fmt: skip
        self._mark_ending(session, prompt_ids, result.finish_type, len(result.output_ids))
        versions = result.token_versions or [result.weight_version] * len(result.output_ids)
        session.calls.append(
            GatewayCall(
                prompt_ids=list(prompt_ids),
                output_ids=list(result.output_ids),
                output_logprobs=list(result.output_logprobs),
                token_versions=list(versions),
                finish_type=result.finish_type,
                weight_version=result.weight_version,
                routed_experts=result.routed_experts,
                images=images,
            )
        )

    async def _stopped(self) -> None:
        """Hold a call of a frozen gateway until `release()`, then refuse it (503)."""
        await self._released.wait()
        raise GatewayError(503, "the orchestrator is stopping (planned stop): its work was saved")

    def release(self) -> None:
        """After a planned stop's checkpoint: the held calls are refused, so the episodes end."""
        self._released.set()

    async def freeze(self, timeout_s: float) -> None:
        """A planned stop: abort every in-flight engine request and wait (at most `timeout_s`) until each
        has its partial output recorded; from now on no call reaches an engine or answers the env."""
        self._frozen.set()
        for session in list(self.sessions.values()):
            engine = self.engines[session.engine_index]
            for rid in list(session.inflight):
                with contextlib.suppress(Exception):  # the request may have finished, the engine be gone
                    await engine.abort_request(rid)
        deadline = time.monotonic() + timeout_s
        while self._at_engine and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if left := len(self._at_engine):
            logger.warning("planned stop: %d engine requests did not return their partial output", left)

    def pending_by_engine(self) -> dict[str, int]:
        """Engine requests of this gateway's episodes that have not answered yet, per engine URL."""
        out = {e.base_url: 0 for e in self.engines}
        for session in self.sessions.values():
            out[self.engines[session.engine_index].base_url] += len(session.inflight)
        return out

    # --- HTTP server ------------------------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.post(GENERATE_ROUTE)
        async def generate(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"error": "body is not JSON"}, status_code=400)
            try:
                return JSONResponse(await self.generate(body))
            except GatewayError as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            self.num_model_list_requests += 1
            # verifiers' renderers client asks for `max_model_len` to refuse overlong prompts up front.
            return {
                "object": "list",
                "data": [{"id": k, "max_model_len": self.seq_len} for k in self.sessions],
            }

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        return app

    async def start(self) -> None:
        import uvicorn

        # proto=IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are
        # TCP, and accepted sockets inherit the listener's proto. With proto 0 the answer's body waited
        # for the ACK of its headers: a 40 ms delayed-ACK stall on ~1 in 4 calls once the connections
        # were busy (async runs), a third of a step on the tiny config.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway")
        deadline = asyncio.get_running_loop().time() + 30
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise RuntimeError("gateway server exited during startup")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError("gateway did not start within 30 s")
            await asyncio.sleep(0.01)
        logger.info("gateway listening on %s", self.base_url)

    async def stop(self) -> None:
        for key in list(self.sessions):
            await self.cancel_session(key)
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._serve_task, timeout=10)
            except TimeoutError:
                self._serve_task.cancel()
        self._server = None
        self._serve_task = None

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
