"""The tiny offline model: HF round trip (save, reload offline, same logits), determinism, chat template."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from prime_async.models.tiny import build_tiny_model  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse the text abc"}]


def logits_of(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_round_trip_offline_same_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: nothing may reach a hub
    assert (tiny_model_dir / "model.safetensors").is_file() and (tiny_model_dir / "config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    input_ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    original = logits_of(tiny_model_dir, input_ids)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "copy", safe_serialization=True)
    tokenizer.save_pretrained(tmp_path / "copy")
    reloaded = logits_of(tmp_path / "copy", input_ids)

    assert original.shape == (1, input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(original).all()
    torch.testing.assert_close(reloaded, original, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(tmp_path / "copy").chat_template == tokenizer.chat_template


def test_same_seed_same_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()


def test_chat_template_is_chatml(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nreverse the text abc<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert text.startswith(no_prompt) and not no_prompt.endswith("assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for special in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(special) in ids, special  # one token each, not split
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"


def test_generation_config_stops_at_im_end(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.vocab_size == len(tokenizer)
