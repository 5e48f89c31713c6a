"""The doctor's image-prompt checks (issue 40) on hand-built probes and engine answers: each flags the fault
it is for (a different expansion, other reply ids, a drifted score, an image prompt over seq_len) with one
line naming the figures, and passes clean input."""

from __future__ import annotations

import dataclasses

from prime_async.doctor.checks import Probe
from prime_async.doctor.images import ImageEcho, image_calls, image_prompt_fits, image_round_trip
from prime_async.rollouts.gateway import GatewayCall
from prime_async.rollouts.images import ImagePrompt, PromptImages
from prime_async.rollouts.types import Episode

PAD = 9


def _probe(example_id: int, image_tokens: int, text: int = 4, reply: int = 2) -> Probe:
    """One turn: `text` tokens around one image of `image_tokens` pad tokens, then `reply` tokens."""
    prompt = [1] * (text // 2) + [PAD] * image_tokens + [2] * (text - text // 2)
    images = ImagePrompt(
        engine_ids=[1] * (text // 2) + [PAD] + [2] * (text - text // 2),
        images=PromptImages(["data:image/png;base64,AA=="], [(text // 2, image_tokens)], [(1, 4, 4)]),
    )
    out = list(range(3, 3 + reply))
    call = GatewayCall(prompt, out, [-0.5] * reply, [0] * reply, "stop", 0, images=images)
    ids = prompt + out
    episode = Episode(
        example_id=example_id, token_ids=ids, loss_mask=[False] * len(prompt) + [True] * reply,
        sampler_logprobs=[0.0] * len(prompt) + [-0.5] * reply,
        token_versions=[-1] * len(prompt) + [0] * reply,
    )  # fmt: skip
    return Probe(example_id, [episode], [call])


def _echo(**changes) -> ImageEcho:
    echo = ImageEcho(0, 0, 1, 8, [3, 4], [-0.5, -0.5], 10, [3, 4], [-0.5, -0.5 + 1e-6])
    return dataclasses.replace(echo, **changes)


def test_image_calls_keeps_calls_with_images_and_a_reply() -> None:
    text_only = Probe(1, [], [GatewayCall([1, 2], [3], [-0.5], [0], "stop", 0)])
    empty_reply = _probe(2, 4, reply=0)
    found = image_calls([text_only, empty_reply, _probe(3, 4), _probe(4, 4)], limit=1)
    assert [(example, turn) for example, turn, _ in found] == [(3, 0)]


def test_round_trip_passes_an_exact_echo_with_its_figures() -> None:
    result = image_round_trip([_echo(), _echo(turn=1)])
    assert result.passed is True
    assert "2 image calls (2 images)" in result.detail and "1.0e-06" in result.detail


def test_round_trip_flags_each_kind_of_difference_in_one_line() -> None:
    cases = {
        "the engine counted 14": _echo(prompt_tokens=14),  # another expansion of the image
        "other reply ids": _echo(echoed=[3, 5]),
        "away from its sampled logprobs": _echo(scored_logprobs=[-0.5, -0.9]),
        "refused the expanded prompt: HTTP 400": _echo(error="HTTP 400: image_data[0]: ..."),
    }
    for words, echo in cases.items():
        result = image_round_trip([_echo(), echo])
        assert result.passed is False and words in result.detail and "1 of 2 image calls" in result.detail
        assert "\n" not in result.detail and result.fix
    assert image_round_trip([]).passed is None


def test_image_prompt_fits_counts_image_tokens() -> None:
    probes = [_probe(0, 4), _probe(1, 16)]
    ok = image_prompt_fits(probes, seq_len=64, max_tokens=8)
    assert ok.passed is True and "20 tokens (16 of them image tokens, 1 image(s); example 1)" in ok.detail
    tight = image_prompt_fits(probes, seq_len=24, max_tokens=8)  # 20 + 8 > 24 only with the image tokens
    assert tight.passed is False and "the prompt is 20 tokens (16 image tokens)" in tight.detail
    assert ">= 28" in tight.fix
    assert image_prompt_fits([Probe(0, [], [GatewayCall([1], [2], [-0.5], [0], "stop", 0)])], seq_len=8,
                             max_tokens=1).passed is None  # fmt: skip


def test_a_refused_image_prompt_names_its_token_count() -> None:
    refused = _probe(7, 16)
    episode = refused.episodes[0]
    episode.metrics["env_error"] = "prompt_too_long"
    episode.error = (
        "prompt_too_long: the prompt is 87 tokens (chat template ...) and does not fit seq_len = 60"
    )
    result = image_prompt_fits([_probe(0, 4), refused], seq_len=60, max_tokens=8)
    assert result.passed is False and "example 7" in result.detail and "87 tokens" in result.detail
