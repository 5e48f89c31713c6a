"""Conformance of the embedded engine with images (SGLang's `image_data`), over HTTP against a real engine
process on the tiny VLM (float32): logprobs vs an HF forward of the same token ids and pixel values,
retract / in_place / drain across a weight update with an image prompt, scoring with images, the image
embedding cache, and a bad image answered with one 400 line while the server keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from prime_async.inference.client import GenerateResult, HttpEngineClient, parse_generate
from proc_helpers import start_embedded_engine

TOL = 1e-4  # float32 engine vs float32 HF (conftest.FP32_LOGPROB_TOL)
LONG = 1500  # still running when the test pauses it


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class VLMEngine:
    url: str
    model_dir: Path
    weights: Path  # what the engine serves now
    version: int = 0


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("engine_vlm")
    config = (
        f'backend = "torch"\nseq_len = 4096\noutput_dir = "{work}"\n[model]\npath = "{tiny_vlm_model_dir}"\n'
        'dtype = "float32"\n[engine]\nmax_running_requests = 16\nnum_threads = 1\n'
    )
    url, proc = start_embedded_engine(config, work, timeout_s=300)
    yield VLMEngine(url, tiny_vlm_model_dir, tiny_vlm_model_dir)
    proc.terminate()
    proc.wait(30)


class Prompts:
    """Chat prompts with images: the ids the engine gets (one placeholder per image) and the processor's
    expanded ids and pixel values (what the HF reference runs)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self._models: dict[Path, torch.nn.Module] = {}

    def make(self, text: str, images: list[Image.Image]) -> tuple[list[int], dict]:
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True
        )
        short = self.processor.tokenizer(chat)["input_ids"]
        return short, self.processor(text=[chat], images=images, return_tensors="pt")

    @torch.no_grad()
    def hf_logprobs(
        self, weights: Path, enc: dict, output: list[int], temperature: float = 1.0
    ) -> list[float]:
        """HF's logprobs of `output` after the expanded prompt of `enc`, with its pixel values."""
        from transformers import AutoModelForImageTextToText

        if weights not in self._models:
            self._models[weights] = AutoModelForImageTextToText.from_pretrained(
                weights, dtype=torch.float32
            ).eval()
        model = self._models[weights]
        prompt = enc["input_ids"][0].tolist()
        ids = torch.tensor([prompt + output])
        mm = (ids == model.config.image_token_id).int()
        logits = model(input_ids=ids, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                       mm_token_type_ids=mm).logits[0, len(prompt) - 1 : -1].float()  # fmt: skip
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def prompts(tiny_vlm_model_dir: Path) -> Prompts:
    torch.set_num_threads(1)
    return Prompts(tiny_vlm_model_dir)


async def generate(url: str, ids: list[int], images: list[Image.Image], params: dict) -> GenerateResult:
    body = {"input_ids": ids, "image_data": [data_url(im) for im in images], "sampling_params": params,
            "return_logprob": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=300) as http:
        r = await http.post(f"{url}/generate", json=body)
    assert r.status_code == 200, r.text
    return parse_generate(r.json(), None)


def max_error(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def _started(client: HttpEngineClient) -> None:
    for i in range(2):  # FIFO: the request sent before these is running once they complete
        await client.generate([7, 8, 9 + i], {"max_new_tokens": 1, "temperature": 0.0})


async def _update(
    engine: VLMEngine, client: HttpEngineClient, path: Path, *, flush_cache: bool = True
) -> int:
    engine.version += 1
    await client.update_weights_from_disk(str(path), engine.version, flush_cache=flush_cache)
    engine.weights = path
    return engine.version


def test_image_logprobs_match_hf_forward(vlm_engine, prompts):
    cases = [("what colour", [noise_image(1, (80, 60))]),
             ("compare them", [noise_image(2, (56, 112)), noise_image(3, (120, 90))]),
             ("and this one", [noise_image(4, (30, 200))])]  # fmt: skip
    made = [prompts.make(text, images) for text, images in cases]

    async def go():
        params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
        pairs = zip(made, cases, strict=True)
        return await asyncio.gather(
            *(generate(vlm_engine.url, ids, ims, params) for (ids, _), (_, ims) in pairs)
        )

    worst = 0.0
    for (_, enc), res in zip(made, asyncio.run(go()), strict=True):
        assert res.meta_info["prompt_tokens"] == enc["input_ids"].shape[1]  # placeholders expanded
        worst = max(
            worst,
            max_error(res.output_logprobs, prompts.hf_logprobs(vlm_engine.weights, enc, res.output_ids)),
        )
    print(f"max |engine - HF| logprob with images: {worst:.2e}")
    assert worst < TOL


def test_expanded_ids_and_batches_agree_with_single_placeholders(vlm_engine, prompts):
    image = noise_image(5, (70, 70))
    short, enc = prompts.make("name it", [image])
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    a = asyncio.run(generate(vlm_engine.url, short, [image], greedy))
    b = asyncio.run(generate(vlm_engine.url, enc["input_ids"][0].tolist(), [image], greedy))
    assert a.output_ids == b.output_ids and a.meta_info["prompt_tokens"] == b.meta_info["prompt_tokens"]
    body = {
        "input_ids": [short, [5, 6, 7]],
        "image_data": [[data_url(image)], None],
        "sampling_params": greedy,
    }
    outs = httpx.post(f"{vlm_engine.url}/generate", json=body, timeout=120).json()
    assert outs[0]["output_ids"] == a.output_ids and outs[1]["meta_info"]["prompt_tokens"] == 3


def test_retract_with_an_image_prompt_recomputes_under_new_weights(
    vlm_engine, prompts, tmp_path, write_weights
):
    new = write_weights(vlm_engine.weights, tmp_path / "w", noise=0.05, seed=21)
    image = noise_image(6, (90, 60))
    short, enc = prompts.make("describe", [image])

    async def go():
        async with HttpEngineClient(vlm_engine.url) as c:
            task = asyncio.create_task(
                generate(vlm_engine.url, short, [image], {"max_new_tokens": LONG, "ignore_eos": True})
            )
            await _started(c)
            old = vlm_engine.version
            await c.pause_generation("retract")
            try:
                version = await _update(vlm_engine, c, new)
            finally:
                await c.continue_generation()
            return old, version, await task

    old, version, res = asyncio.run(go())
    assert len(res.output_ids) == LONG
    switch = res.token_versions.index(version)
    assert switch > 0 and set(res.token_versions[:switch]) == {old}
    # the re-prefill ran the vision tower and the prompt under the new weights: the tail is HF's of them
    enc_tail = dict(enc)
    enc_tail["input_ids"] = torch.tensor([enc["input_ids"][0].tolist() + res.output_ids[:switch]])
    tail = prompts.hf_logprobs(new, enc_tail, res.output_ids[switch : switch + 32])
    assert max_error(res.output_logprobs[switch : switch + 32], tail) < TOL


def test_in_place_with_an_image_prompt_keeps_its_tokens(vlm_engine, prompts, tmp_path, write_weights):
    new = write_weights(vlm_engine.weights, tmp_path / "w", noise=0.05, seed=22)
    image = noise_image(7, (60, 90))
    short, enc = prompts.make("go on", [image])
    before = vlm_engine.weights

    async def go():
        async with HttpEngineClient(vlm_engine.url) as c:
            params = {"max_new_tokens": LONG, "ignore_eos": True}
            task = asyncio.create_task(generate(vlm_engine.url, short, [image], params))
            await _started(c)
            old = vlm_engine.version
            await c.pause_generation("in_place")
            try:
                version = await _update(vlm_engine, c, new, flush_cache=False)  # the paused request holds KV
            finally:
                await c.continue_generation()
            res = await task
            await c.flush_cache()
            return old, version, res

    old, version, res = asyncio.run(go())
    assert len(res.output_ids) == LONG and res.token_versions[0] == old and res.token_versions[-1] == version
    switch = res.token_versions.index(version)
    # tokens sampled before the update are the old weights' (image tokens at their M-RoPE positions)
    head = prompts.hf_logprobs(before, enc, res.output_ids[: min(switch, 32)])
    assert max_error(res.output_logprobs[: min(switch, 32)], head) < TOL


def test_drain_update_waits_and_drops_the_cached_image_embeddings(
    vlm_engine, prompts, tmp_path, write_weights
):
    """An update sent without a pause waits for the running image request (all its tokens are the old
    version); the next request with the same image is HF's under the new weights, so the vision tower ran
    again (its cached embeddings were the old weights')."""
    new = write_weights(vlm_engine.weights, tmp_path / "w", noise=0.05, seed=23)
    image = noise_image(8, (80, 80))
    short, enc = prompts.make("drain", [image])
    params = {"max_new_tokens": 300, "ignore_eos": True}
    info = lambda: httpx.get(f"{vlm_engine.url}/get_server_info", timeout=10).json()  # noqa: E731

    async def go():
        async with HttpEngineClient(vlm_engine.url) as c:
            task = asyncio.create_task(generate(vlm_engine.url, short, [image], params))
            await _started(c)
            old = vlm_engine.version
            await _update(vlm_engine, c, new)  # deferred by the engine until the request is done
            first = await task
            encoded = info()["images_encoded"]
            again = await generate(vlm_engine.url, short, [image], {**params, "max_new_tokens": 16})
            cached = await generate(vlm_engine.url, short, [image], {**params, "max_new_tokens": 4})
            return old, first, encoded, again, cached

    old, first, encoded, again, cached = asyncio.run(go())
    assert set(first.token_versions) == {old} and set(again.token_versions) == {vlm_engine.version}
    assert max_error(again.output_logprobs, prompts.hf_logprobs(new, enc, again.output_ids)) < TOL
    now = info()
    assert now["images_encoded"] == encoded + 1 and now["image_cache_hits"] >= 1  # `cached` hit the cache
    assert cached.output_ids


def test_scoring_with_images_gives_back_the_sampled_logprobs(vlm_engine, prompts):
    """The OPD teacher path: a scoring request (max_new_tokens = 0) over the expanded prompt + completion,
    with the same images, returns the logprobs the engine sampled with."""
    images = [noise_image(9, (64, 64)), noise_image(10, (100, 40))]
    short, enc = prompts.make("score me", images)
    res = asyncio.run(generate(vlm_engine.url, short, images, {"max_new_tokens": 12, "ignore_eos": True}))
    prompt = enc["input_ids"][0].tolist()
    body = {"input_ids": prompt + res.output_ids, "image_data": [data_url(im) for im in images],
            "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": len(prompt)}  # fmt: skip
    r = httpx.post(f"{vlm_engine.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    scored = r.json()["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scored] == res.output_ids
    assert max_error([lp for lp, _, _ in scored], res.output_logprobs) < TOL


def _png_bytes_truncated() -> str:
    buf = io.BytesIO()
    noise_image(11, (60, 60)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()[:100]).decode()


BAD_IMAGES = {
    "truncated png": (_png_bytes_truncated(), "image_data[0][0]: not a decodable image"),
    "not base64": ("%%%", "image_data[0][0]: neither a data URL"),
    "url": ("https://example.com/cat.png", "image_data[0][0]: image URLs are not fetched"),
    "text data url": ("data:text/plain,hello", "image_data[0][0]: a data URL must be base64"),
    "no placeholder": (None, "image_data[0]: 1 images for 0 runs"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_is_400_naming_it_and_server_keeps_serving(vlm_engine, prompts, case):
    item, message = BAD_IMAGES[case]
    short, _ = prompts.make("bad", [noise_image(12, (60, 60))])
    ids = [5, 6, 7] if item is None else short
    body = {"input_ids": ids, "image_data": [item or data_url(noise_image(12, (60, 60)))],
            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    r = httpx.post(f"{vlm_engine.url}/generate", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    ok = asyncio.run(generate(vlm_engine.url, short, [noise_image(12, (60, 60))], {"max_new_tokens": 2}))
    assert ok.output_ids
