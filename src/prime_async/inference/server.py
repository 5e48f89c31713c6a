"""HTTP server of the embedded engine: the subset of SGLang's native API that the orchestrator uses.

`run(cfg)` is called by `prime_async.entrypoints.inference` (the only config parser); backend = "sglang"
delegates to `inference/sglang_launcher.py`.

Routes: POST /generate (`lora_path` per prompt; `image_data` for vision-language models,
`inference/images.py`), /pause_generation, /continue_generation,
/update_weights_from_disk, /init_weights_update_group, /begin_weight_update, /update_weights_from_distributed,
/end_weight_update, /destroy_weights_update_group (gloo on CPU, nccl on CUDA; `weights/receiver.py`),
/update_weights_from_tensor (a shared-memory version described in JSON, never a pickle;
`weights/shared_memory.py`),
/load_lora_adapter, /unload_lora_adapter, /update_weight_version, /abort_request; GET|POST /flush_cache;
GET /model_info (alias /get_model_info), /health, /get_server_info. Invariants: a bad request is answered
with HTTP 400 and `{"error": {"message"}}` and never reaches the engine, so the server keeps serving and the
weights stay; when `server.api_key` is set every route but /health requires `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from prime_async.config.inference import InferenceConfig
from prime_async.inference.api import (
    AbortReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    PauseReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
    generate_response,
    score_response,
)
from prime_async.inference.engine import Engine
from prime_async.inference.engine_settings import EngineSettings
from prime_async.inference.images import ImageInputs, ImagePrompt
from prime_async.utils.mem_fraction import apply_mem_fraction
from prime_async.weights.receiver import WeightReceiver
from prime_async.weights.shared_memory import open_share
from prime_async.weights.shared_wire import decode_share

logger = logging.getLogger(__name__)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)


def _check_prompts(engine: Engine, items: list) -> None:
    for prompt, sp, _, _ in items:
        if not prompt:
            raise ValueError("input_ids is empty")
        bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} out of vocabulary [0, {engine.vocab_size})")
        if len(prompt) + sp.max_new_tokens > engine.max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceeds the "
                f"context length {engine.max_len}"
            )
        bad_stop = [t for t in sp.stop_token_ids or () if not 0 <= t < engine.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids: {bad_stop[0]} out of vocabulary [0, {engine.vocab_size})")


async def _prepare_images(
    inputs: ImageInputs | None, items: list, per_prompt: list[list[str]]
) -> list[ImagePrompt | None]:
    """Each prompt's images decoded and preprocessed, placeholders expanded (`inference/images.py`), off
    the event loop; ValueError (HTTP 400) naming a bad image or placeholder run."""
    if inputs is None:
        if any(per_prompt):
            raise ValueError("image_data: this model has no vision tower (a text-only model)")
        return [None] * len(items)

    def prepare() -> list[ImagePrompt | None]:
        pairs = zip(items, per_prompt, strict=True)
        return [inputs.prepare(it[0], imgs, f"image_data[{i}]") for i, (it, imgs) in enumerate(pairs)]

    return await asyncio.to_thread(prepare)


async def _score(
    engine: Engine,
    items: list,
    starts: list[int],
    top_n: int = 0,
    images: list[ImagePrompt | None] | None = None,
) -> list[dict[str, Any]]:
    """The `max_new_tokens = 0` items of a request: prompt logprobs from `logprob_start_len` on, one
    forward for all of them (SGLang's scoring request: no output token); `top_n` > 0: with the top-n
    of each position (`input_top_logprobs`); `images[r]`: item r's images."""
    if not items:
        return []
    t0 = time.monotonic()
    version = engine.weight_version
    prompts, temps = [p for p, _, _, _ in items], [sp.temperature for _, sp, _, _ in items]
    if top_n > 0:
        scored = await engine.score_top(prompts, temps, top_n, images)
    else:
        scored = [(lps, None) for lps in await engine.score(prompts, temps, images)]
    latency = time.monotonic() - t0
    return [
        score_response(
            prompt, lps, start if return_logprob else -1, rid=rid, weight_version=version, latency_s=latency,
            tops=tops,
        )
        for (prompt, _, return_logprob, rid), (lps, tops), start in zip(items, scored, starts, strict=True)
    ]  # fmt: skip


def build_app(
    engine: Engine, *, api_key: str | None = None, model_path: str = "", run_id: str | None = None
) -> FastAPI:
    """FastAPI app over a started or unstarted engine (the lifespan starts and stops it).

    `run_id` is reported by `/model_info`, so a launcher can tell its own engine from another run's."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if not engine.alive:
            engine.start()
        yield
        receiver.leave_all()
        engine.stop()

    receiver = WeightReceiver(engine.runner.device)
    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc))

    @app.exception_handler(ValueError)
    async def _on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        authorized = request.headers.get("authorization") == f"Bearer {api_key}"
        if api_key and request.url.path != "/health" and not authorized:
            return _error(401, "missing or wrong API key")
        return await call_next(request)

    images = ImageInputs.for_model(engine.model_path, engine.runner.model.config)
    _add_generation_routes(app, engine, run_id, images)
    _add_admin_routes(app, engine, model_path)
    _add_distributed_routes(app, engine, receiver)
    _add_tensor_routes(app, engine)
    return app


async def _generate(engine: Engine, image_inputs: ImageInputs | None, req: GenerateReqInput) -> Any:
    """`/generate`: images prepared and placeholders expanded first, then the scoring items in one forward
    and the generation items through the engine; answers in the request's order."""
    items = req.items()
    images = await _prepare_images(image_inputs, items, req.images(len(items)))
    items = [(p if img is None else img.ids, *rest) for (p, *rest), img in zip(items, images, strict=True)]
    _check_prompts(engine, items)
    loras = req.loras(len(items))
    scored = [i for i, (_, sp, _, _) in enumerate(items) if sp.max_new_tokens == 0]
    starts = req.logprob_starts(len(items))
    if req.top_logprobs_num > 0 and len(scored) < len(items):
        raise ValueError("top_logprobs_num is served for scoring requests (max_new_tokens = 0) only")
    top_n = req.top_logprobs_num
    scores = await _score(
        engine,
        [items[i] for i in scored],
        [starts[i] for i in scored],
        top_n,
        [images[i] for i in scored],
    )
    outs = await asyncio.gather(
        *(
            engine.generate(
                prompt,
                sp.to_params(),
                rid,
                lora,
                return_routed_experts=req.return_routed_experts,
                images=img,
            )
            for (prompt, sp, _, rid), lora, img in zip(items, loras, images, strict=True)
            if sp.max_new_tokens > 0
        )
    )
    generated = iter(outs)
    by_index = dict(zip(scored, scores, strict=True))
    answers = [
        by_index[i] if i in by_index else generate_response(next(generated), bool(lp))
        for i, (_, _, lp, _) in enumerate(items)
    ]
    batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
    return answers if batched else answers[0]


def _add_generation_routes(
    app: FastAPI, engine: Engine, run_id: str | None = None, image_inputs: ImageInputs | None = None
) -> None:
    @app.post("/generate")
    async def generate(req: GenerateReqInput) -> Any:
        return await _generate(engine, image_inputs, req)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        cfg = engine.runner.model.config
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "run_id": run_id,
            "has_image_understanding": image_inputs is not None,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": list(cfg.architectures or []),
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"context_length": engine.max_len, "weight_version": engine.weight_version, **engine.stats()}


def _add_admin_routes(app: FastAPI, engine: Engine, model_path: str) -> None:
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        body = await request.body()
        req = PauseReqInput.model_validate_json(body) if body.strip() else PauseReqInput()
        await engine.pause(req.mode)
        return {"message": "Generation paused successfully."}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        await engine.resume()
        return {"message": "Generation continued successfully."}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskReqInput) -> JSONResponse:
        try:
            ok, message, num_paused = await engine.update_weights(
                req.model_path, req.weight_version, flush_cache=req.flush_cache,
                abort_all=req.abort_all_requests,
            )  # fmt: skip
        except ValueError as exc:  # invalid weights: nothing was changed
            version = req.weight_version
            logger.error("refused weights %s (v%s), old weights kept: %s", req.model_path, version, exc)
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        body = {"success": ok, "message": message, "num_paused_requests": num_paused}
        return JSONResponse(body, status_code=200 if ok else 400)

    _add_lora_routes(app, engine)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        ok = await engine.flush_cache()
        if ok:
            return PlainTextResponse("Cache flushed.\n", status_code=200)
        return PlainTextResponse(
            "Cache not flushed: requests are running or hold KV cache.\n", status_code=400
        )

    @app.post("/abort_request")
    async def abort_request(req: AbortReqInput) -> Response:
        if not req.abort_all and not req.rid:
            raise ValueError("abort_request needs `rid` or `abort_all: true`")
        await engine.abort(req.rid or None, abort_all=req.abort_all)
        return Response(status_code=200)


def _add_distributed_routes(app: FastAPI, engine: Engine, receiver: WeightReceiver) -> None:
    """SGLang's weight-update-group routes; answers `{"success", "message"}` (400 on failure)."""

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        try:
            await receiver.join(
                master_address=req.master_address, master_port=req.master_port, rank_offset=req.rank_offset,
                world_size=req.world_size, group_name=req.group_name, backend=req.backend,
            )  # fmt: skip
        except (ValueError, RuntimeError) as exc:  # a bad request or a failed rendezvous: reported
            message = f"Failed to initialize custom process group: {exc}."
            logger.error(message)
            return JSONResponse({"success": False, "message": message}, status_code=400)
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        try:
            tensors = await receiver.receive(req.group_name, req.names, req.dtypes, req.shapes)
            if req.abort_all_requests:
                await engine.abort(None, abort_all=True)
            ok, message, _ = await engine.load_tensors(
                tensors, req.weight_version, flush_cache=req.flush_cache, source=f"group {req.group_name}"
            )
        except (ValueError, RuntimeError) as exc:  # invalid bucket or broken group: old weights kept
            logger.error("refused distributed weights (v%s): %s", req.weight_version, exc)
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    @app.post("/begin_weight_update")
    async def begin_weight_update() -> JSONResponse:
        """SGLang's weight-update session; the embedded engine loads in place and needs none (accepted)."""
        return JSONResponse({"success": True, "message": "Success"})

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        return JSONResponse({"success": True, "message": "Success"})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        if receiver.leave(req.group_name):
            return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})
        body = {"success": False, "message": "The group to be destroyed does not exist."}
        return JSONResponse(body, status_code=400)


def _add_tensor_routes(app: FastAPI, engine: Engine) -> None:
    """SGLang's `/update_weights_from_tensor`: a version lent in shared memory (`weights.transport =
    "shared"`); answers `{"success", "message"}` (400 on failure, old weights kept)."""

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorReqInput) -> JSONResponse:
        """A version the trainer lends in shared memory: map it, copy every tensor, unmap (old weights kept
        on any error). The answer comes after the copy finished (CUDA: synchronized)."""
        try:
            share = decode_share(req.serialized_named_tensors[0])
            if req.abort_all_requests:
                await engine.abort(None, abort_all=True)
            with open_share(share) as tensors:
                ok, message, _ = await engine.load_tensors(
                    tensors, req.weight_version, flush_cache=req.flush_cache, partial=False,
                    source=f"shared memory (v{share.version})",
                )  # fmt: skip
        except (ValueError, RuntimeError) as exc:  # bad description, unmappable buffer, invalid tensors
            logger.error("refused shared weights (v%s): %s", req.weight_version, exc)
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)


def _lora_answer(engine: Engine, error: str | None = None) -> JSONResponse:
    """SGLang's `LoRAUpdateOutput`: success, error_message, loaded_adapters {name: path}."""
    loaded = {name: a.raw.path for name, a in engine.runner.adapters.items()}
    body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=200 if error is None else 400)


def _add_lora_routes(app: FastAPI, engine: Engine) -> None:
    """SGLang's dynamic LoRA routes and `/update_weight_version` (labels the served version)."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterReqInput) -> JSONResponse:
        try:
            await engine.load_lora_adapter(req.lora_name, req.lora_path)
        except ValueError as exc:
            logger.error("refused LoRA adapter %s (%s): %s", req.lora_name, req.lora_path, exc)
            return _lora_answer(engine, str(exc))
        return _lora_answer(engine)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterReqInput) -> JSONResponse:
        try:
            await engine.unload_lora_adapter(req.lora_name)
        except ValueError as exc:
            return _lora_answer(engine, str(exc))
        return _lora_answer(engine)

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionReqInput) -> JSONResponse:
        if req.abort_all_requests:
            await engine.abort(None, abort_all=True)
        await engine.set_weight_version(req.new_version)
        body = {"success": True, "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version}  # fmt: skip
        return JSONResponse(body)


def build_engine(cfg: InferenceConfig) -> Engine:
    return Engine(EngineSettings.from_config(cfg))


def run(cfg: InferenceConfig) -> None:
    """Serve until interrupted: embedded engine with uvicorn, or SGLang server(s) via the launcher."""
    if cfg.backend == "sglang":
        from prime_async.inference.sglang_launcher import run_sglang

        run_sglang(cfg)
        return
    import uvicorn

    if cfg.server.port == 0:
        raise ValueError("server.port = 0 (a free port) works only under `rl`: give inference a port")
    engine = build_engine(cfg)
    apply_mem_fraction(cfg.engine.mem_fraction, engine.runner.device, who="inference engine")
    app = build_app(engine, api_key=cfg.server.api_key, model_path=cfg.model.path, run_id=cfg.run_id)
    logger.info(
        "embedded engine serving %s on http://%s:%d", cfg.model.path, cfg.server.host, cfg.server.port
    )
    uvicorn.run(app, host=cfg.server.host, port=cfg.server.port, log_level="warning", access_log=False)
