"""Tells verifiers' renderers client the gateway's prompt limit up front, so no episode has to ask.

renderers' `generate` refuses an overlong prompt before sending it: it looks up `max_model_len` with
`GET {base_url}/models` once per (base_url, model), caches the answer in
`renderers.client._max_prompt_len_cache`, and takes one process-wide asyncio lock for each lookup. The
gateway names each episode's model by its session key (`gateway.py`), so every episode paid that round
trip, one episode after the other on the lock: on `configs/tiny/rl.toml` in async mode the first model
call of a batch waited ~40 ms for it (a third of a step), until the gateway began recycling keys. The
gateway's answer is always `seq_len`, so the rollout source records it for the key as it opens the
session (in-process runner only: with `runner = "env_server"` the client lives in the other process).

Invariants: the recorded value is exactly what `GET /v1/models` answers for that key (`seq_len`, see
the gateway's `models` route); keys are recycled by the gateway, so the entries stay bounded and right;
a renderers release without that cache makes `record` a no-op (the client then asks, as before).
"""

from __future__ import annotations

import functools

import httpx


@functools.cache  # called for every episode with the one gateway URL of its source
def client_base_url(base_url: str) -> str:
    """The base URL as the OpenAI SDK spells it (trailing slash), which renderers uses in its key."""
    url = httpx.URL(base_url)
    return str(url if url.raw_path.endswith(b"/") else url.copy_with(raw_path=url.raw_path + b"/"))


def record(base_url: str, model: str, max_model_len: int) -> bool:
    """Record `max_model_len` for requests to `model` at `base_url`; False when renderers has no cache."""
    try:
        from renderers import client as renderers_client
    except ImportError:
        return False
    cache = getattr(renderers_client, "_max_prompt_len_cache", None)
    if not isinstance(cache, dict):
        return False
    cache[(client_base_url(base_url), model)] = max_model_len
    return True
