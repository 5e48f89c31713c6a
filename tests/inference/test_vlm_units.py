"""The embedded engine's image path without a server: image decoding and its errors, placeholder expansion
(as the HF processor expands), M-RoPE positions (as transformers' `get_rope_index`), and the runner's
prefill / decode / scoring with images against an HF forward of the same pixel values."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from PIL import Image  # noqa: E402
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor  # noqa: E402

from prime_async.inference.images import ImageInputs, decode_image, expand_placeholders  # noqa: E402
from prime_async.inference.model_runner import ModelRunner  # noqa: E402
from prime_async.inference.vision import mrope_positions  # noqa: E402

TOL = 1e-4  # float32 engine vs float32 HF


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PARTS = [
    {"type": "image"},
    {"type": "text", "text": "what is it"},
    {"type": "image"},
    {"type": "text", "text": "and"},
]
MESSAGES = [{"role": "user", "content": PARTS}]
IMAGES = [noise_image(0, (80, 60)), noise_image(1, (50, 100))]


@pytest.fixture(scope="module")
def vlm(tiny_vlm_model_dir: Path):
    """(processor, HF model, ImageInputs, short prompt ids, processor output) of two images."""
    processor = AutoProcessor.from_pretrained(tiny_vlm_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_model_dir, dtype=torch.float32).eval()
    inputs = ImageInputs.for_model(str(tiny_vlm_model_dir), AutoConfig.from_pretrained(tiny_vlm_model_dir))
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    short = processor.tokenizer(text)["input_ids"]
    enc = processor(text=[text], images=IMAGES, return_tensors="pt")
    return processor, model, inputs, short, enc


def hf_logprobs(model, ids: list[int], enc) -> torch.Tensor:
    """log_softmax of every position of `ids` (expanded), images as the processor gave them."""
    full = torch.tensor([ids])
    mm = (full == model.config.image_token_id).int()
    with torch.no_grad():
        out = model(input_ids=full, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                    mm_token_type_ids=mm)  # fmt: skip
    return torch.log_softmax(out.logits[0].float(), -1)


def test_prepare_expands_as_the_processor(vlm) -> None:
    _, _, inputs, short, enc = vlm
    prompt = inputs.prepare(short, [data_url(im) for im in IMAGES], "image_data[0]")
    assert prompt.ids == enc["input_ids"][0].tolist()
    assert torch.equal(prompt.pixel_values, enc["pixel_values"].float())
    assert prompt.grids == [tuple(g) for g in enc["image_grid_thw"].tolist()]
    again = inputs.prepare(prompt.ids, [data_url(im) for im in IMAGES], "image_data[0]")  # pre-expanded
    assert again.ids == prompt.ids and again.keys == prompt.keys and again.runs == prompt.runs


def test_bad_images_and_placeholders_are_named(vlm, tmp_path: Path) -> None:
    _, _, inputs, short, _ = vlm
    url = data_url(IMAGES[0])
    with pytest.raises(ValueError, match=r"image_data\[0\]\[1\]: not a decodable image"):
        inputs.prepare(short, [url, "data:image/png;base64," + base64.b64encode(b"not a png").decode()],
                       "image_data[0]")  # fmt: skip
    with pytest.raises(ValueError, match=r"image_data\[0\]\[0\]: image URLs are not fetched"):
        decode_image("https://example.com/a.png", "image_data[0][0]")
    with pytest.raises(ValueError, match="neither a data URL, a local file nor valid base64"):
        decode_image("%%% not base64", "image_data[0][0]")
    with pytest.raises(ValueError, match="1 images for 2 runs"):
        inputs.prepare(short, [url], "image_data[0]")
    with pytest.raises(ValueError, match="0 images for 2 runs"):
        inputs.prepare(short, [], "image_data[0]")
    path = tmp_path / "a.png"
    IMAGES[0].save(path)
    assert decode_image(str(path), "x").size == IMAGES[0].size
    with pytest.raises(ValueError, match=r"x\[1\]: its placeholder run has 3 tokens; the image needs"):
        expand_placeholders([1, 9, 2, 9, 9, 9], 9, [4, 4], "x")


def test_mrope_positions_are_transformers(vlm) -> None:
    _, model, inputs, short, enc = vlm
    prompt = inputs.prepare(short, [data_url(im) for im in IMAGES], "p")
    ids = torch.tensor([[*prompt.ids, 5, 6]])
    mm = (ids == model.config.image_token_id).int()
    want, delta = model.model.get_rope_index(ids, mm, image_grid_thw=enc["image_grid_thw"])
    got, got_delta = mrope_positions(ids.shape[1], prompt, 2)
    assert torch.equal(got, want[:, 0]) and got_delta == int(delta)


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_runner_prefill_decode_and_score_match_hf(vlm, tiny_vlm_model_dir: Path, decode_step: str) -> None:
    _, model, inputs, short, enc = vlm
    prompt = inputs.prepare(short, [data_url(im) for im in IMAGES], "p")
    tail = [5, 6, 7]
    ref = hf_logprobs(model, prompt.ids + tail, enc)
    runner = ModelRunner(model_path=str(tiny_vlm_model_dir), dtype="float32", device="cpu", num_slots=2,
                         max_len=256, chunk=64, decode_step=decode_step)  # fmt: skip
    n = len(prompt.ids)
    scored = torch.tensor(runner.score([prompt.ids + tail], [1.0], [prompt])[0])
    want = ref[:-1].gather(1, torch.tensor(prompt.ids[1:] + tail)[:, None])[:, 0]
    assert (scored - want).abs().max() < TOL
    logits = runner.prefill([prompt.ids], [1], None, [prompt])  # slot 1, then compacted into slot 0
    assert runner.rope_offset[1] < 0
    runner.move_slot(1, 0, n)
    assert (torch.log_softmax(logits[0], -1) - ref[n - 1]).abs().max() < TOL
    text = [11, 12, 13, 14, 15]  # a text-only row beside it (offset 0) in the same decode steps
    runner.prefill([text], [1])
    with torch.no_grad():
        text_ref = torch.log_softmax(model(input_ids=torch.tensor([text + tail])).logits[0].float(), -1)
    for k, tok in enumerate(tail):
        out = torch.log_softmax(runner.decode_rows([tok, tok], [n + k, len(text) + k]), -1)
        assert (out[0] - ref[n + k]).abs().max() < TOL
        assert (out[1] - text_ref[len(text) + k]).abs().max() < TOL
    assert runner.vision.images_encoded == 2 and runner.vision.cache_hits == 2  # prefill reused the score's
    runner.load_weights(str(tiny_vlm_model_dir))
    runner.score([prompt.ids], [1.0], [prompt])
    assert runner.vision.images_encoded == 4  # a weight load drops the cached embeddings


def test_lora_on_the_language_model_with_images(vlm, tiny_vlm_model_dir: Path, tmp_path: Path) -> None:
    """A PEFT adapter on the VLM's decoder layers (named under `language_model.`) serves image prompts: the
    runner's prefill with it equals the HF forward of the adapted model with the same pixel values."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from prime_async.inference.lora import Adapter, read_adapter

    _, _, inputs, short, enc = vlm
    prompt = inputs.prepare(short, [data_url(im) for im in IMAGES], "p")
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_model_dir, dtype=torch.float32).eval()
    targets = r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|v_proj)|mlp\.down_proj)"
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(0)
    state = {}
    for name, p in peft.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.2)
            state["base_model.model." + name.removeprefix("base_model.model.").replace(".default", "")] = (
                p.data
            )
    peft.peft_config["default"].save_pretrained(str(tmp_path))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "adapter_model.safetensors"))
    ref = hf_logprobs(peft, prompt.ids, enc)[-1]

    runner = ModelRunner(model_path=str(tiny_vlm_model_dir), dtype="float32", device="cpu", num_slots=2,
                         max_len=256, chunk=64)  # fmt: skip
    raw = read_adapter("a", str(tmp_path), num_layers=len(runner.layers), shapes=runner.linear_shapes(),
                       max_rank=None)  # fmt: skip
    adapter = Adapter(raw, runner.fold_adapter(raw))
    logits = runner.prefill([prompt.ids], [0], [adapter], [prompt])
    base_logits = runner.prefill([prompt.ids], [1], None, [prompt])
    assert (torch.log_softmax(logits[0], -1) - ref).abs().max() < TOL
    assert (torch.log_softmax(base_logits[0], -1) - ref).abs().max() > 1e-3  # the adapter mattered


def test_vision_cache_evicts_least_recent_by_tokens(vlm, tiny_vlm_model_dir: Path) -> None:
    _, _, inputs, short, _ = vlm
    runner = ModelRunner(model_path=str(tiny_vlm_model_dir), dtype="float32", device="cpu", num_slots=1,
                         max_len=256, chunk=64)  # fmt: skip
    tower = runner.vision
    same = inputs.prepare(short, [data_url(IMAGES[0])] * 2, "p")  # one image twice: encoded once
    first = tower.embeddings(same)
    assert tower.images_encoded == 1 and tower.cache_hits == 1 and torch.equal(first[0], first[1])
    tower.max_cached_tokens = first[0].shape[0]  # room for one image
    other = inputs.prepare(short, [data_url(IMAGES[1])] * 2, "p")
    tower.embeddings(other)
    tower.embeddings(same)  # evicted by `other`: encoded again
    assert tower.images_encoded == 3
