"""Episodes with images (issue 40): image-shapes on the tiny VLM through verifiers, the gateway and a
scripted engine that answers a fixed reply and records what it was sent.

Checks the path from the env's image content parts to the engine (`image_data`, the unexpanded prompt)
and into the Episode (expanded ids, each image's placement per turn, image tokens never trained), and the
refusals: a corrupt image (an episode error naming the image), a prompt whose images do not fit
`seq_len` (one line with its token count).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
from pathlib import Path
from typing import Any

import pytest

from prime_async.config.env import EnvConfig
from prime_async.engine_api import GenerateResult, SamplingParams
from prime_async.rollouts.images import ImageError, ImagePlacer
from prime_async.rollouts.types import Episode
from prime_async.rollouts.verifiers_source import build_rollout_source

pytest.importorskip("verifiers.v1")

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8)


class ScriptedEngine:
    """Answers every request with `reply` (logprob -0.5 per token, version 3); records the requests."""

    def __init__(self, reply: list[int]) -> None:
        self.base_url = "scripted://vlm"
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        self.metrics: dict[str, float] = {}
        self._ids = itertools.count()

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None,
        image_data: list[str] | None = None,
    ) -> GenerateResult:  # fmt: skip
        self.requests.append({"input_ids": list(input_ids), "image_data": image_data})
        out = self.reply[: int(sampling_params.get("max_new_tokens", 8))]
        rid = rid or f"s-{next(self._ids)}"
        return GenerateResult(rid, out, [-0.5] * len(out), [3] * len(out), "stop", len(input_ids), 3)

    async def abort_request(self, rid: str) -> None:
        return None


def _episodes(model_dir: Path, engine: ScriptedEngine, seq_len: int, **args: Any) -> list[Episode]:
    """Episodes of examples 0 and 1; the source's metrics after them go to `engine.metrics`."""
    env_cfg = EnvConfig(id="image-shapes", args={"num_examples": 4, "turns": 2, **args})

    async def main() -> list[Episode]:
        async with build_rollout_source(
            env_cfg=env_cfg, engines=[engine], model_path=str(model_dir), seq_len=seq_len
        ) as source:
            out = [await source.run_episode(example_id=i, engine_key="0", sampling=SAMPLING) for i in (0, 1)]
            engine.metrics = source.metrics()
            return out

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tokenizer(tiny_vlm_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_vlm_model_dir))


def test_images_of_every_turn_reach_the_engine_and_the_episode(
    tiny_vlm_model_dir: Path, tokenizer: Any
) -> None:
    reply = [
        *tokenizer.encode("red", add_special_tokens=False),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    engine = ScriptedEngine(reply)
    episodes = _episodes(tiny_vlm_model_dir, engine, 512)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [len(r["image_data"]) for r in engine.requests] == [1, 2, 1, 2]  # turn 2 holds both images
    assert all(r["input_ids"].count(pad) == len(r["image_data"]) for r in engine.requests)  # unexpanded
    for ep in episodes:
        assert ep.status == "ok", ep.error
        assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == reply * 2
        assert [img.turn for img in ep.images] == [0, 1]
        for img in ep.images:
            span = ep.token_ids[img.offset : img.offset + img.length]
            assert img.length == 4 and span == [pad] * 4  # 56 x 56: 4 tokens on the tiny processor
            assert not any(ep.loss_mask[img.offset : img.offset + img.length])
            assert all(v == -1 for v in ep.token_versions[img.offset : img.offset + img.length])
            assert img.url.startswith("data:image/png;base64,") and img.grid_thw == (1, 4, 4)
        assert ep.token_ids.count(pad) == 8 and ep.metrics["images"] == 2
        assert ep.metrics["env/images"] == 2.0
    assert engine.metrics["env/images"] == 4.0  # images in ok trajectories, cumulative


def test_placer_refuses_a_corrupt_image_naming_it(tiny_vlm_model_dir: Path) -> None:
    placer = ImagePlacer(str(tiny_vlm_model_dir))
    with pytest.raises(ImageError, match="image 1 of the prompt does not decode"):
        placer.place([1, placer.image_token_id, 2], ["data:image/png;base64,AAAA"])
    with pytest.raises(ImageError, match="remote URL"):
        placer.place([placer.image_token_id], ["https://example.com/x.png"])
    with pytest.raises(ImageError, match="1 image placeholder tokens but 2 images"):
        placer.place([placer.image_token_id], ["a", "b"])


def test_a_prompt_whose_images_do_not_fit_seq_len_is_an_episode_error(
    tiny_vlm_model_dir: Path, tokenizer: Any
) -> None:
    engine = ScriptedEngine([tokenizer.convert_tokens_to_ids("<|im_end|>")])
    episodes = _episodes(tiny_vlm_model_dir, engine, 60, size=112)  # 16 image tokens each
    assert not engine.requests, "never sent"
    for ep in episodes:
        assert ep.status == "error" and ep.metrics["env_error"] == "prompt_too_long", ep.error
        assert "the prompt is" in ep.error and "seq_len = 60" in ep.error


def test_placer_refuses_a_sampled_video_placeholder(tiny_vlm_model_dir: Path) -> None:
    placer = ImagePlacer(str(tiny_vlm_model_dir))
    with pytest.raises(ImageError, match="video placeholder token"):
        placer.place([1, int(placer.video_token_id)], [])


def test_a_text_model_refuses_images_and_a_recorded_call_keeps_them(
    tiny_vlm_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prime_async.orchestrator.carry import decode_call, encode_call
    from prime_async.rollouts.gateway import Gateway, GatewayError

    placer = ImagePlacer(str(tiny_vlm_model_dir))
    url = "data:image/png;base64," + base64.b64encode(_png_bytes()).decode()
    body = {"token_ids": [1, placer.image_token_id, 2], "content_parts": [{"type": "image_url", "url": url}]}

    async def call(images: ImagePlacer | None) -> tuple[dict[str, Any], Gateway]:
        gateway = Gateway(engines=[ScriptedEngine([7, 8])], seq_len=64, images=images)
        session = gateway.open_session(engine_key="0")
        return await gateway.generate({**body, "model": session.key}), gateway

    with pytest.raises(GatewayError, match="not a vision-language model"):
        asyncio.run(call(None))
    answer, gateway = asyncio.run(call(placer))
    assert answer["prompt_token_ids"] == [1, *[placer.image_token_id] * 4, 2]
    assert answer["mm_placeholders"] == {"image": [{"offset": 1, "length": 4}]}
    (recorded,) = next(iter(gateway.sessions.values())).calls
    assert recorded.images is not None and recorded.images.engine_ids == [1, placer.image_token_id, 2]
    assert decode_call(encode_call(recorded)) == recorded
    # the scripted engine counts the unexpanded prompt (3 tokens): another expansion than the gateway's
    assert "counts 3 prompt tokens for an image prompt the gateway expanded to 6" in caplog.text


def _png_bytes() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()
