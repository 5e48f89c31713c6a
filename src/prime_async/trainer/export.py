"""Merge a LoRA adapter into its base model: `W' = W + (alpha / r) B A` for every adapted layer, saved as
a plain HF model directory (safetensors, config, tokenizer) that loads without peft.

Called by `entrypoints/export_lora.py`. Invariants: the adapter directory is validated first (ValueError
naming the problem: not an adapter, no base model); an existing non-empty output directory is refused
(nothing is overwritten); the merged model computes what base + unmerged adapter computes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from prime_async.config.export import ExportLoraConfig
from prime_async.weights.broadcasts import read_adapter_config
from prime_async.weights.writer import TOKENIZER_FILES

logger = logging.getLogger(__name__)


def _base_dir(cfg: ExportLoraConfig, adapter_cfg: dict) -> Path:
    base = cfg.base or adapter_cfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{cfg.adapter}: adapter_config.json names no base model: pass --base")
    if not (Path(base) / "config.json").is_file():
        raise ValueError(f"base model {base} is not a local HF model directory (no config.json): pass --base")
    return Path(base)


def merge_adapter(adapter: Path, base: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The base model with the adapter merged into its weights (a plain transformers model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()


def run(cfg: ExportLoraConfig) -> Path:
    adapter_cfg = read_adapter_config(cfg.adapter)
    base = _base_dir(cfg, adapter_cfg)
    out = Path(cfg.output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output {out} exists and is not empty: choose a new directory")
    merged = merge_adapter(Path(cfg.adapter), base, getattr(torch, cfg.dtype))
    merged.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base / name).is_file() and not (out / name).exists():
            shutil.copy2(base / name, out / name)
    logger.info("merged %s into %s: %s", cfg.adapter, base, out)
    return out
