"""Build a tiny random Qwen2.5-VL-style vision-language model and its processor, fully offline.

Used by tests and `configs/tiny/rl_vlm.toml` (`model.build = "tiny_vlm"`). The language model is the tiny
model's shape (`models/tiny.py`: same BPE vocabulary, ChatML template) with Qwen2.5-VL's multimodal rotary
positions (M-RoPE); the vision tower is Qwen2.5-VL's (patch 14, temporal patch 2, spatial merge 2, window
attention) at two blocks of width 64, its merger projecting into the language model's width.

The output is a plain HF directory that `AutoModelForImageTextToText` and `AutoProcessor` load with
`HF_HUB_OFFLINE=1`: config.json, model.safetensors, the tokenizer, preprocessor_config.json and
chat_template (in tokenizer_config.json and the processor's files).

Invariants:
- The vision tokens `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>` come after the
  tiny tokenizer's vocabulary (BPE ids and the tool tokens keep the tiny model's ids); config.json names
  their ids (`image_token_id`, `vision_start_token_id`, ...).
- A user message's `{"type": "image"}` content part renders as `<|vision_start|><|image_pad|><|vision_end|>`;
  the processor expands the one `<|image_pad|>` into `t * h * w / merge**2` copies (`image_grid_thw`).
- Images are resized by the processor to between `MIN_PIXELS` and `MAX_PIXELS` (multiples of 28): an image
  costs 4 to 16 tokens.
- The same `seed` gives byte-identical weights.
"""

from __future__ import annotations

from pathlib import Path

from prime_async.models.tiny import CHATML_TEMPLATE, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2.5-VL's vision special tokens, appended after the tiny tokenizer's vocabulary."""
PATCH_SIZE, TEMPORAL_PATCH, MERGE_SIZE = 14, 2, 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 4  # 56 x 56: 4 image tokens
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 16  # 112 x 112: 16 image tokens

_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
_TEXT_TURN = "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
assert _TEXT_TURN in CHATML_TEMPLATE
VLM_CHAT_TEMPLATE = CHATML_TEMPLATE.replace(
    _TEXT_TURN, "{{ '<|im_start|>' + message['role'] + '\n' }}" + _CONTENT
)
"""The tiny model's template (ChatML, Qwen3 tool layout) with content parts: text parts verbatim, image
parts (`image`, `image_url`) as the vision block."""


def _tokenizer(out: Path, *, vocab_size: int, seed: int):
    """The tiny tokenizer plus the vision tokens and the multimodal chat template, saved into `out`."""
    tok = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def _config(tok, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, max_positions: int):
    """Qwen2.5-VL config: the tiny language model's shape, M-RoPE sections over half the head dim, and a
    two-block vision tower whose merger outputs `hidden_size`."""
    from transformers import Qwen2_5_VLConfig

    half = hidden_size // num_heads // 2
    hw = half * 3 // 8  # mrope sections (t, h, w) sum to head_dim / 2, in Qwen2.5-VL's 16:24:24 ratio
    text = {
        "vocab_size": len(tok), "hidden_size": hidden_size, "intermediate_size": hidden_size * 3,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "mrope_section": [half - 2 * hw, hw, hw]},
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"), "pad_token_id": tok.pad_token_id,
        "bos_token_id": None, "tie_word_embeddings": True,
    }  # fmt: skip
    vision = {
        "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
        "out_hidden_size": hidden_size, "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH, "window_size": 56, "fullatt_block_indexes": [1],
    }  # fmt: skip
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def _processor(out: Path, tok) -> None:
    """Qwen2.5-VL processor (image processor sized by `MIN_PIXELS`/`MAX_PIXELS`) saved into `out`."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    sizes = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "patch_size": PATCH_SIZE,
             "temporal_patch_size": TEMPORAL_PATCH, "merge_size": MERGE_SIZE}  # fmt: skip
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**sizes),
        chat_template=VLM_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def build_tiny_vlm(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a tiny random Qwen2_5_VLForConditionalGeneration (~1M params) plus processor into `out_dir`."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out, vocab_size=vocab_size, seed=seed)
    config = _config(
        tok, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, max_positions=max_position_embeddings,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    _processor(out, tok)
    return out
