"""`EngineClient` over HTTP: SGLang's native routes and payloads only, so it drives real SGLang servers
and the embedded engine alike. Used by the orchestrator (one client per engine).

Invariants: every `generate` asks for logprobs and returns one logprob and one weight version per output
token (versions from `meta_info.weight_versions` spans; where a server reports no spans, every token
gets `meta_info.weight_version`). Non-2xx answers raise `EngineError` carrying the status and message;
an engine that cannot be reached raises `EngineUnavailable` (no httpx type leaves this module); the client
never retries on its own (the caller decides what a failure costs).
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import httpx

from prime_async.engine_api import EngineClient, EngineUnavailable, FinishType, GenerateResult
from prime_async.types import EnginePauseMode
from prime_async.weights.shared_wire import SHARED_LOAD_FORMAT, SharedVersion, encode_share

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine answered with an error status (4xx: bad request, 5xx: engine failure)."""

    def __init__(self, status: int, route: str, message: str):
        super().__init__(f"{route} -> HTTP {status}: {message}")
        self.status = status
        self.route = route


def parse_version(value: Any) -> int:
    """SGLang weight versions are strings; ours are integers. "default" is SGLang's unlabelled v0."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"weight version {value!r} is not an integer: launch SGLang with --weight-version 0"
        ) from None


def token_versions(meta: dict[str, Any], num_tokens: int) -> list[int]:
    """Per-output-token versions from `weight_versions` spans (fallback: `weight_version` for all)."""
    spans = meta.get("weight_versions")
    if not spans:
        return [parse_version(meta.get("weight_version"))] * num_tokens
    versions: list[int | None] = [None] * num_tokens
    for span in spans:
        v = parse_version(span["version"])
        for i in range(int(span["start"]), min(int(span["end"]), num_tokens)):
            versions[i] = v
    if any(v is None for v in versions):
        raise ValueError(f"weight_versions spans {spans} do not cover {num_tokens} output tokens")
    return versions  # type: ignore[return-value]


def parse_generate(body: dict[str, Any], rid: str | None) -> GenerateResult:
    """One SGLang `/generate` answer -> `GenerateResult`."""
    meta = body["meta_info"]
    output_ids = list(body["output_ids"])
    items = meta.get("output_token_logprobs") or []
    if len(items) != len(output_ids) or any(int(it[1]) != t for it, t in zip(items, output_ids, strict=True)):
        raise ValueError(f"output_token_logprobs do not align with output_ids (rid {meta.get('id')})")
    finish = meta.get("finish_reason") or {"type": "abort"}
    finish_type: FinishType = finish["type"] if finish["type"] in ("stop", "length") else "abort"
    return GenerateResult(
        rid=str(meta.get("id", rid)),
        output_ids=output_ids,
        output_logprobs=[float(it[0]) for it in items],
        token_versions=token_versions(meta, len(output_ids)),
        finish_type=finish_type,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        weight_version=parse_version(meta.get("weight_version")),
        meta_info=meta,
        routed_experts=parse_routed_experts(meta),
    )


def parse_routed_experts(meta: dict[str, Any]):
    """SGLang's `meta_info.routed_experts` (base64 of int32) as a flat numpy array, or None."""
    raw = meta.get("routed_experts")
    if raw is None:
        return None
    import numpy as np

    return np.frombuffer(base64.b64decode(raw), dtype=np.int32)


def _top_maps(meta: dict[str, Any]) -> list[dict[int, float]]:
    """`meta_info.input_top_logprobs` as one {token id: logprob} per position ({} for a null entry)."""
    return [{int(t): float(lp) for lp, t, *_ in top or []} for top in meta["input_top_logprobs"]]


class HttpEngineClient:
    """One engine at `base_url` (e.g. http://127.0.0.1:30000)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        admin_timeout_s: float = 600.0,
        return_routed_experts: bool = False,
    ):
        self.base_url = base_url.rstrip("/")
        self.return_routed_experts = return_routed_experts  # MoE routing replay: ask for every request
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._admin_timeout = httpx.Timeout(admin_timeout_s, connect=10.0)
        # generation may take arbitrarily long; hundreds of requests run concurrently per engine
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(
        self, route: str, payload: dict[str, Any] | None = None, *, admin: bool = True
    ) -> httpx.Response:
        kwargs: dict[str, Any] = {"timeout": self._admin_timeout} if admin else {}
        try:
            resp = await self._http.post(route, json=payload or {}, **kwargs)
        except httpx.TransportError as e:
            raise EngineUnavailable(f"{self.base_url}{route}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise EngineError(resp.status_code, route, resp.text.strip())
        return resp

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        *,
        lora_path: str | None = None,
        image_data: list[str] | None = None,
    ) -> GenerateResult:
        """`/generate`; `lora_path` names a loaded LoRA adapter (SGLang's field), None = the base model;
        `image_data`: the prompt's images in placeholder order (SGLang's field: data URLs or paths)."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        if rid is not None:
            payload["rid"] = rid
        if lora_path is not None:
            payload["lora_path"] = lora_path
        if image_data:
            payload["image_data"] = list(image_data)
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
        resp = await self._post("/generate", payload, admin=False)
        return parse_generate(resp.json(), rid)

    async def score(
        self, sequences: list[list[int]], starts: list[int], *, temperature: float = 1.0,
        image_data: list[list[str]] | None = None,
    ) -> list[list[float]]:  # fmt: skip
        """Prompt logprobs (SGLang's scoring request: `max_new_tokens = 0`, `return_logprob`,
        `logprob_start_len`), one batched `/generate`: per sequence, the logprob of each token from
        `starts[i]` (>= 1) on given the tokens before it. An answer not in SGLang's shape (not JSON, no
        `meta_info`, other tokens) raises EngineError. `image_data[i]`: sequence i's images (SGLang's
        field), its placeholder runs already expanded."""
        scored = await self.score_top(sequences, starts, 0, temperature=temperature, image_data=image_data)
        return [lps for lps, _ in scored]

    async def score_top(
        self, sequences: list[list[int]], starts: list[int], top_n: int, *, temperature: float = 1.0,
        image_data: list[list[str]] | None = None,
    ) -> list[tuple[list[float], list[dict[int, float]]]]:  # fmt: skip
        """`score`, and with `top_n` > 0 (SGLang's `top_logprobs_num`) the top-n {token id: logprob} of each
        of the same positions (`meta_info.input_top_logprobs`; [] for each sequence when top_n = 0)."""
        if any(start < 1 for start in starts):
            raise ValueError(f"score: every start must be >= 1 (token 0 has no logprob), got {starts}")
        payload: dict[str, Any] = {
            "input_ids": [list(s) for s in sequences],
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": list(starts),
        }
        if top_n > 0:
            payload["top_logprobs_num"] = top_n
        if image_data is not None and any(image_data):
            payload["image_data"] = [list(images) for images in image_data]
        resp = await self._post("/generate", payload, admin=False)
        try:
            answers = resp.json()
            if not isinstance(answers, list) or len(answers) != len(sequences):
                raise ValueError(f"expected a list of {len(sequences)} answers")
            pairs = [
                [(it[0], it[1]) for it in a["meta_info"].get("input_token_logprobs") or []] for a in answers
            ]
            tops = [_top_maps(a["meta_info"]) if top_n > 0 else [] for a in answers]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # not SGLang's shape
            raise EngineError(resp.status_code, "/generate", f"malformed scoring answer ({type(e).__name__}: "
                              f"{e}): {resp.text[:200]!r}") from None  # fmt: skip
        out = []
        for seq, start, items in zip(sequences, starts, pairs, strict=True):
            numbers = all(isinstance(lp, int | float) for lp, _ in items)
            if [token for _, token in items] != list(seq[start:]) or not numbers:
                raise EngineError(200, "/generate", f"scoring answered {len(items)} logprobs for positions "
                                  f"{start}..{len(seq) - 1} that do not match the tokens sent")  # fmt: skip
            out.append([float(lp) for lp, _ in items])
        return list(zip(out, tops, strict=True))

    async def pause_generation(self, mode: EnginePauseMode) -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, *, flush_cache: bool, abort_all_requests: bool = False
    ) -> None:
        payload = {
            "model_path": str(model_path),
            "weight_version": str(weight_version),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        resp = await self._post("/update_weights_from_disk", payload)
        body = resp.json()
        if not body.get("success", False):
            raise EngineError(resp.status_code, "/update_weights_from_disk", str(body.get("message")))

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str,
    ) -> None:  # fmt: skip
        """Join the weight process group (blocks until every rank joined; the trainer is rank 0)."""
        payload = {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }  # fmt: skip
        await self._post_checked("/init_weights_update_group", payload)

    async def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: int | None, flush_cache: bool,
    ) -> None:  # fmt: skip
        """Receive one bucket broadcast by rank 0 of `group_name` (labelled `weight_version` if given)."""
        payload: dict[str, Any] = {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "abort_all_requests": False,
        }  # fmt: skip
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._post_checked("/update_weights_from_distributed", payload)

    async def update_weights_from_shared(
        self, share: SharedVersion, *, weight_version: int, flush_cache: bool
    ) -> None:
        """Copy a version the trainer lends in shared memory (`weights.transport = "shared"`): the embedded
        engine's `/update_weights_from_tensor` with our JSON description (`load_format =
        SHARED_LOAD_FORMAT`), never a pickle. SGLang's route of that name takes pickled tensors: `rl`
        refuses SGLang with this transport (docs/weights.md)."""
        payload = {
            "serialized_named_tensors": [encode_share(share)], "load_format": SHARED_LOAD_FORMAT,
            "weight_version": str(weight_version), "flush_cache": flush_cache, "abort_all_requests": False,
        }  # fmt: skip
        await self._post_checked("/update_weights_from_tensor", payload)

    async def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session (0.5.23 refuses /update_weights_from_distributed outside)."""
        await self._post_checked("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._post_checked("/end_weight_update", {})

    async def destroy_weights_update_group(self, group_name: str) -> bool:
        """Leave `group_name`; False when the engine was not in it (SGLang answers 400 then)."""
        try:
            await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})
        except EngineError as e:
            if e.status == 400:
                return False
            raise
        return True

    async def _post_checked(self, route: str, payload: dict[str, Any]) -> None:
        resp = await self._post(route, payload)
        body = resp.json()
        if not body.get("success", False):
            raise EngineError(resp.status_code, route, str(body.get("message")))

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def _lora_update(self, route: str, payload: dict[str, Any]) -> dict[str, str]:
        try:
            resp = await self._post(route, payload)
        except EngineError as e:  # SGLang answers 400 with {"success": false, "error_message"}
            raise EngineError(e.status, route, str(e)) from None
        body = resp.json()
        if not body.get("success", False):
            raise EngineError(resp.status_code, route, str(body.get("error_message")))
        return dict(body.get("loaded_adapters") or {})

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """`/load_lora_adapter`; returns the loaded adapters {name: path}."""
        return await self._lora_update("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """`/unload_lora_adapter` (the engine drops it once its running requests end)."""
        return await self._lora_update("/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, version: int) -> None:
        """Relabel the served version without aborting anything (SGLang defaults to aborting all)."""
        payload = {"new_version": str(version), "abort_all_requests": False}
        resp = await self._post("/update_weight_version", payload)
        if not resp.json().get("success", False):
            raise EngineError(resp.status_code, "/update_weight_version", resp.text.strip())

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        await self._post("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def model_info(self) -> dict[str, Any]:
        """`GET /model_info`: model path, weight version, and (embedded engine) the run id."""
        return await self._get("/model_info")

    async def server_info(self) -> dict[str, Any]:
        """`GET /get_server_info`: queue lengths and, from the embedded engine, `busy_s` / `uptime_s`."""
        return await self._get("/get_server_info")

    async def _get(self, route: str) -> dict[str, Any]:
        try:
            resp = await self._http.get(route, timeout=self._admin_timeout)
        except httpx.TransportError as e:
            raise EngineUnavailable(f"{self.base_url}{route}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise EngineError(resp.status_code, route, resp.text.strip())
        return resp.json()

    async def weight_version(self) -> int:
        return parse_version((await self.model_info()).get("weight_version"))

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=httpx.Timeout(10.0))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200


def engine_clients(
    urls: list[str], api_key: str | None, *, lora: bool, routed_experts: bool = False
) -> list[EngineClient]:
    """One client per engine URL: LoRA-aware when the run trains adapters; asking every request for its
    routed experts when the run replays MoE routing."""
    from prime_async.weights.lora_client import LoraEngineClient

    clients: list[EngineClient] = [
        HttpEngineClient(url, api_key, return_routed_experts=routed_experts) for url in urls
    ]
    return [LoraEngineClient(c) for c in clients] if lora else clients
