"""The tiny offline VLM: loads offline as a Qwen2.5-VL with its processor, images expand into placeholder
tokens, the forward uses the pixels, the chat template renders image parts, same seed same bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from PIL import Image  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer  # noqa: E402

from prime_async.models.tiny_vlm import build_tiny_vlm  # noqa: E402

MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape"}]}
]


def test_processor_expands_the_image_and_the_forward_reads_the_pixels(tiny_vlm_model_dir: Path) -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    processor = AutoProcessor.from_pretrained(tiny_vlm_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_model_dir, dtype=torch.float32).eval()
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>what colour" in text
    red, blue = Image.new("RGB", (80, 60), (200, 10, 10)), Image.new("RGB", (80, 60), (10, 10, 200))
    enc = processor(text=[text], images=[red], return_tensors="pt")
    grid = enc["image_grid_thw"][0].tolist()
    assert grid == [1, 4, 6]  # 60 x 80 resized to 56 x 84: (56 / 14) x (84 / 14) patches
    pad = model.config.image_token_id
    assert (enc["input_ids"][0] == pad).sum().item() == grid[0] * grid[1] * grid[2] // 4  # merge 2 x 2
    other = processor(text=[text], images=[blue], return_tensors="pt")
    with torch.no_grad():
        a, b = model(**enc).logits, model(**other).logits
    assert a.shape == (1, enc["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(a).all() and not torch.allclose(a[0, -1], b[0, -1])


def test_tokenizer_keeps_the_tiny_ids_and_adds_the_vision_tokens(
    tiny_vlm_model_dir: Path, tiny_model_dir: Path
) -> None:
    vlm, tiny = (
        AutoTokenizer.from_pretrained(tiny_vlm_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    assert len(vlm) == len(tiny) + 4
    for token in ("<|im_end|>", "<|im_start|>", "<think>", "<tool_call>"):
        assert vlm.convert_tokens_to_ids(token) == tiny.convert_tokens_to_ids(token)
    plain = [{"role": "user", "content": "reverse the text abc"}]
    assert vlm.apply_chat_template(plain, tokenize=False) == tiny.apply_chat_template(plain, tokenize=False)


def test_same_seed_same_bytes(tiny_vlm_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_vlm(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "processor_config.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_vlm_model_dir / name).read_bytes(), name
