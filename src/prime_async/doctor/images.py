"""The doctor's image-prompt checks (vision-language models, issue 40).

    diagnose: engine up ──echo_images(url, probes)──► each image call's expanded prompt + its reply sent
              back as token ids with its images (a scoring request) ──► `image_round_trip` ──► a row
              `image_prompt_fits(probes)` ──► a row (first prompts, image tokens counted)

Round trip: the gateway expands each image's one placeholder token into the image's `t * h * w / 4` tokens
(`rollouts/images.py`) and records that prompt; the episode trains on it. Sent back to the engine as
token ids with the same `image_data` (the engine takes a run of exactly that length as already expanded),
the engine must count the same prompt (`meta_info.prompt_tokens`), echo the reply's ids, and score the
reply as it sampled it (same engine, version 0): a different expansion would shift every later position.

Invariants: `echo_images` sends at most `limit` calls, in probe order, and never raises for one call's
failure (its `ImageEcho.error` names it); `image_round_trip` and `image_prompt_fits` are pure and are
skipped (passed None) when no probe call had images.
"""

from __future__ import annotations

from dataclasses import dataclass

from prime_async.doctor.checks import CheckResult, Probe
from prime_async.rollouts.gateway import GatewayCall

ECHO_LOGPROB_LIMIT = 1e-3  # |scored - sampled| logprob of a reply token; CPU float32 measures ~1e-6
ROUND_TRIP = "image prompts round-trip"
FITS = "image prompt fits seq_len"


@dataclass(frozen=True)
class ImageEcho:
    """One image call sent back: what was sent (`prompt` + `reply` ids) and what the engine answered."""

    example_id: int
    turn: int
    images: int
    prompt_len: int
    reply: list[int]
    sampled_logprobs: list[float]
    prompt_tokens: int = -1  # the engine's count of the whole sequence sent
    echoed: list[int] | None = None
    scored_logprobs: list[float] | None = None
    error: str = ""


def image_calls(probes: list[Probe], limit: int) -> list[tuple[int, int, GatewayCall]]:
    """(example id, turn, call) of the first `limit` calls with images and a sampled reply."""
    found = [
        (p.example_id, turn, call)
        for p in probes
        for turn, call in enumerate(p.calls)
        if call.images is not None and call.output_ids
    ]
    return found[:limit]


async def echo_images(
    url: str, api_key: str | None, probes: list[Probe], temperature: float, *, limit: int = 8,
    timeout_s: float = 60.0,
) -> list[ImageEcho]:  # fmt: skip
    """Send back the first `limit` image calls of `probes` (module docstring), one request each."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s) as client:
        for example_id, turn, call in image_calls(probes, limit):
            assert call.images is not None  # image_calls keeps calls with images only
            echo = ImageEcho(
                example_id, turn, len(call.images.images.urls), len(call.prompt_ids), list(call.output_ids),
                list(call.output_logprobs),
            )  # fmt: skip
            payload = {
                "input_ids": [*call.prompt_ids, *call.output_ids],
                "image_data": list(call.images.images.urls),
                "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                "return_logprob": True,
                "logprob_start_len": len(call.prompt_ids),
            }
            out.append(await _echo(client, payload, echo))
    return out


async def _echo(client, payload: dict, echo: ImageEcho) -> ImageEcho:
    """`echo` with the engine's answer to `payload`, or with the one-line error it got."""
    import dataclasses

    import httpx

    try:
        resp = await client.post("/generate", json=payload)
        if resp.status_code != 200:
            return dataclasses.replace(echo, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
        meta = resp.json()["meta_info"]
        pairs = meta.get("input_token_logprobs") or []  # SGLang's (logprob, token id, text) items
        return dataclasses.replace(
            echo, prompt_tokens=int(meta["prompt_tokens"]), echoed=[int(it[1]) for it in pairs],
            scored_logprobs=[float(it[0]) for it in pairs],
        )  # fmt: skip
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # the row names it; the doctor goes on
        return dataclasses.replace(echo, error=f"{type(e).__name__}: {e}"[:300])


def _echo_problem(echo: ImageEcho) -> tuple[str, float]:
    """(what differs, '' when nothing; the largest |scored - sampled| logprob of the reply)."""
    where = f"example {echo.example_id} turn {echo.turn}"
    if echo.error:
        return f"{where}: the engine refused the expanded prompt: {echo.error}", 0.0
    sent = echo.prompt_len + len(echo.reply)
    if echo.prompt_tokens != sent:
        return f"{where}: sent {sent} tokens, the engine counted {echo.prompt_tokens}", 0.0
    if echo.echoed != echo.reply:
        return f"{where}: the engine echoed other reply ids {echo.echoed} than sampled {echo.reply}", 0.0
    diff = max(abs(a - b) for a, b in zip(echo.scored_logprobs or [], echo.sampled_logprobs, strict=True))
    if diff > ECHO_LOGPROB_LIMIT:
        return f"{where}: the reply scores {diff:.2e} away from its sampled logprobs", diff
    return "", diff


def image_round_trip(echoes: list[ImageEcho]) -> CheckResult:
    """Every image call sent back as its expanded token ids is counted, echoed and scored as sampled."""
    if not echoes:
        return CheckResult(ROUND_TRIP, None, "no model call had images")
    problems = [_echo_problem(e) for e in echoes]
    bad = [p for p, _ in problems if p]
    worst = max(d for _, d in problems)
    images = sum(e.images for e in echoes)
    if bad:
        return CheckResult(
            ROUND_TRIP, False, f"{len(bad)} of {len(echoes)} image calls differ; first: {bad[0]}",
            "the gateway's expansion (rollouts/images.py, the model's image processor) and the engine's "
            "must give every image the same number of tokens: same model directory, same processor config",
        )  # fmt: skip
    return CheckResult(
        ROUND_TRIP, True, f"{len(echoes)} image calls ({images} images) sent back as expanded token ids: "
        f"same count, same reply ids, max |logprob diff| {worst:.1e} (limit {ECHO_LOGPROB_LIMIT:.0e})",
    )  # fmt: skip


def _image_tokens(probe: Probe) -> tuple[int, int]:
    """(image tokens, images) of the probe's first prompt."""
    images = probe.calls[0].images if probe.calls else None
    if images is None:
        return 0, 0
    return sum(n for _, n in images.images.spans), len(images.images.spans)


def image_prompt_fits(probes: list[Probe], *, seq_len: int, max_tokens: int | None) -> CheckResult:
    """The longest first prompt with images, image tokens included, leaves `max_tokens` within `seq_len`;
    an image episode refused as too long fails with its error line (which names its token count)."""
    with_images = [p for p in probes if _image_tokens(p)[1]]
    refused = [
        (p.example_id, e.error) for p in probes for e in p.episodes
        if e.metrics.get("env_error") == "prompt_too_long"
    ]  # fmt: skip
    if refused:
        example, error = refused[0]
        return CheckResult(
            FITS, False, f"{len(refused)} episodes refused; first: example {example}: {error}",
            "raise seq_len, or send smaller images (fewer image tokens each)",
        )  # fmt: skip
    if not with_images:
        return CheckResult(FITS, None, "no first prompt had images")
    longest = max(with_images, key=lambda p: len(p.calls[0].prompt_ids))
    tokens, images = _image_tokens(longest)
    length = len(longest.calls[0].prompt_ids)
    detail = (
        f"longest first prompt with images {length} tokens ({tokens} of them image tokens, {images} "
        f"image(s); example {longest.example_id}), seq_len {seq_len}, max_tokens {max_tokens}"
    )
    if max_tokens is not None and seq_len - length < max_tokens:
        return CheckResult(
            FITS, False, f"the prompt is {length} tokens ({tokens} image tokens): {detail}",
            f"raise seq_len to >= {length + max_tokens}, or send smaller images",
        )  # fmt: skip
    return CheckResult(FITS, True, detail)
