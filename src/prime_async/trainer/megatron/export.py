"""Convert a megatron-backend checkpoint to an HF model directory (`uv run export-megatron`).

One CPU process (world size 1, gloo) builds the GPTModel at TP = PP = 1, loads only the model shards of
the checkpoint (saved at any layout: dist_checkpointing reshards), maps the weights back to HF names with
the same bridge that publishes weight versions, and writes safetensors + config + tokenizer files.

Invariants: the checkpoint is validated first (a ValueError names a missing `COMPLETE` marker, an fsdp
checkpoint or an unknown base directory); an existing non-empty output directory is refused; the written
weights equal what the trainer would have published at that step.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from prime_async.config.export import ExportMegatronConfig
from prime_async.config.megatron import MegatronConfig, read_hf_config
from prime_async.trainer.ckpt import COMPLETE, read_state
from prime_async.weights.writer import TOKENIZER_FILES

logger = logging.getLogger(__name__)


def _base_dir(cfg: ExportMegatronConfig, recorded: str | None) -> Path:
    base = cfg.base or recorded
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(
            f"base model {base!r} is not a local HF model directory (no config.json): pass --base"
        )
    return Path(base)


def megatron_checkpoint_to_hf(checkpoint: Path, base: Path, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF state dict of `checkpoint` (needs a world-size-1 process group and, on CPU, CPU ranks)."""
    from prime_async.trainer.megatron.checkpoint import load_model_shards
    from prime_async.trainer.megatron.model import (
        build_gpt_model,
        export_hf_state_dict,
        init_parallel_state,
    )

    layout = MegatronConfig()
    hf = read_hf_config(base)
    init_parallel_state(layout)
    model = build_gpt_model(hf, layout, dtype=dtype, device=torch.device("cpu"))
    load_model_shards(checkpoint, model)
    state = export_hf_state_dict(model, hf, layout)
    assert state is not None  # world size 1: this is global rank 0
    return state


def run(cfg: ExportMegatronConfig) -> Path:
    checkpoint, out = Path(cfg.checkpoint), Path(cfg.output)
    if not (checkpoint / COMPLETE).is_file():
        raise ValueError(f"{checkpoint} is not a complete trainer checkpoint (no {COMPLETE} marker)")
    base = _base_dir(cfg, read_state(checkpoint, backend="megatron").get("model_path"))
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output {out} exists and is not empty: choose a new directory")
    from prime_async.trainer.megatron.backend import init_single_process_group
    from prime_async.trainer.megatron.cpu_ranks import enable_cpu_ranks

    if not torch.cuda.is_available():
        enable_cpu_ranks()
    init_single_process_group(torch.device("cpu"))
    try:
        state = megatron_checkpoint_to_hf(checkpoint, base, dtype=getattr(torch, cfg.dtype))
    finally:
        dist.destroy_process_group()
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(base)
    config.dtype = cfg.dtype
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    logger.info("exported %s (base %s) to %s: %d tensors", checkpoint, base, out, len(state))
    return out
