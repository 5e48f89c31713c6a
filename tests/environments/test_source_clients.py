"""The rollout source's shortcuts around verifiers' per-episode HTTP: the renderers prompt-limit record
and the pooled model-call client of the in-process harness."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1")

from prime_async.rollouts import inprocess_harness, prompt_limit


def test_prompt_limit_key_matches_the_train_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """renderers keys its cache by `str(client.base_url)` of verifiers' TrainClient: ours must match."""
    import verifiers.v1 as vf
    from renderers import client as renderers_client
    from verifiers.v1.clients.base import build_async_openai

    monkeypatch.setenv("PRIME_ASYNC_GATEWAY_KEY", "unused")
    base_url = "http://127.0.0.1:4321/v1"
    cfg = vf.TrainClientConfig(base_url=base_url, api_key_var="PRIME_ASYNC_GATEWAY_KEY")
    assert prompt_limit.client_base_url(base_url) == str(build_async_openai(cfg).base_url)
    assert prompt_limit.client_base_url(base_url + "/") == str(build_async_openai(cfg).base_url)
    assert prompt_limit.record(base_url, "ep-1", 256)
    key = (str(build_async_openai(cfg).base_url), "ep-1")
    assert renderers_client._max_prompt_len_cache[key] == 256


def test_prompt_limit_answers_without_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """renderers' own lookup returns the recorded limit without calling the client."""
    from renderers import client as renderers_client

    class NoNetwork:
        base_url = prompt_limit.client_base_url("http://127.0.0.1:4322/v1")

        async def get(self, *args: object, **kwargs: object) -> object:
            raise AssertionError("GET /models was sent")

    prompt_limit.record("http://127.0.0.1:4322/v1", "ep-9", 128)
    limit = asyncio.run(renderers_client._resolve_max_prompt_len(NoNetwork(), "ep-9"))  # type: ignore[arg-type]
    assert limit == 128


def test_shared_http_client_per_loop_closed_by_last_user() -> None:
    async def main() -> None:
        inprocess_harness.retain_http_clients()
        inprocess_harness.retain_http_clients()
        first = inprocess_harness.shared_http_client(600.0)
        assert inprocess_harness.shared_http_client(600.0) is first
        assert inprocess_harness.shared_http_client(30.0) is not first
        await inprocess_harness.release_http_clients()
        assert not first.is_closed  # one source still uses it
        await inprocess_harness.release_http_clients()
        assert first.is_closed
        again = inprocess_harness.shared_http_client(600.0)  # a later episode gets a fresh pool
        assert again is not first and not again.is_closed
        await again.aclose()

    asyncio.run(main())
    seen: list[object] = []

    async def other_loop() -> None:
        seen.append(inprocess_harness.shared_http_client(600.0))
        await inprocess_harness.release_http_clients()

    asyncio.run(other_loop())
    asyncio.run(other_loop())
    assert seen[0] is not seen[1]  # never shared across event loops
