"""Full training-state checkpoints for `--resume`: `output_dir/checkpoints/trainer/step_{n}/`.

This module holds the directory protocol both backends share (`atomic_step_dir`, `read_state`) and the
fsdp backend's state; the megatron backend's sharded state is in `trainer/megatron/checkpoint.py`.
`step_{n}` holds the state after n trainer steps (batches of `optim.num_steps_per_batch` optimizer
steps each; the next batch to train is n; the weights are version n). For fsdp: model and optimizer
(full, unsharded state dicts, so a different world size can resume), LR scheduler, step, torch RNG.
Called by the trainer's main loop on every rank (gathering the state is a collective); rank 0 writes.

Invariants:
- atomic: written under `checkpoints/trainer/.tmp_step_{n}`, `COMPLETE` written last, then renamed;
- `latest_checkpoint` returns the newest directory with `COMPLETE`; newer incomplete ones are skipped
  with a warning, never loaded;
- files are read with `torch.load(weights_only=True)` (no arbitrary pickle execution);
- `trainer.pt` names the backend that wrote it: the other backend refuses it (`read_state`).
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STATE_FILE = "trainer.pt"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_root(output_dir: Path) -> Path:
    """Beside the orchestrator's `checkpoints/orchestrator/`."""
    return Path(output_dir) / "checkpoints" / "trainer"


def checkpoint_steps(output_dir: Path, *, warn: bool = True) -> list[int]:
    """Steps of complete checkpoints, ascending (incomplete ones are skipped, with a warning if `warn`)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        if p.name.startswith("step_") and p.name[5:].isdigit():
            if (p / COMPLETE).is_file():
                steps.append(int(p.name[5:]))
            elif warn:
                logger.warning("skipping incomplete checkpoint %s (no %s marker)", p, COMPLETE)
    return sorted(steps)


def latest_checkpoint(output_dir: Path) -> Path | None:
    steps = checkpoint_steps(output_dir)
    return checkpoint_root(output_dir) / f"step_{steps[-1]}" if steps else None


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded model state dict on CPU (collective under FSDP; every rank gets it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextmanager
def atomic_step_dir(output_dir: Path, step: int, *, keep: int | None, subdirs: tuple[str, ...] = ()):
    """Collective: yields `checkpoints/trainer/.tmp_step_{step}` (made by rank 0, with `subdirs`, before
    any rank writes); after every rank has left the block, rank 0 writes `COMPLETE`, renames it to
    `step_{step}` and keeps the newest `keep` checkpoints. Used by both backends."""
    root = checkpoint_root(output_dir)
    tmp, final = root / f".tmp_step_{step}", root / f"step_{step}"
    if _is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in ("", *subdirs):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
    _barrier()
    yield tmp
    _barrier()
    if _is_rank0():
        (tmp / COMPLETE).write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep is not None:
            for old in checkpoint_steps(output_dir, warn=False)[:-keep]:
                shutil.rmtree(root / f"step_{old}", ignore_errors=True)
        logger.info("checkpoint saved: %s", final)
    _barrier()


def write_state(path: Path, state: dict) -> None:
    """`torch.save` + fsync (the state must be on disk before `COMPLETE` is)."""
    torch.save(state, path)
    with path.open("rb") as fh:
        os.fsync(fh.fileno())


def read_state(path: Path, *, backend: str) -> dict:
    """The `trainer.pt` of checkpoint `path` (weights only); a checkpoint of the other backend is refused
    with a ValueError naming both (their model layouts differ)."""
    state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
    saved = state.get("backend", "fsdp")
    if saved != backend:
        raise ValueError(
            f"checkpoint {path} was written by trainer.backend = '{saved}' but this trainer is '{backend}': "
            f"resume with backend = '{saved}', or start a new output_dir"
        )
    return state


def save_checkpoint(
    *,
    output_dir: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    keep: int | None,
    trainable_only: bool = False,
) -> None:
    """Collective: gather full states, rank 0 writes `checkpoints/trainer/step_{step}` atomically.

    `trainable_only` (LoRA): the model state holds only parameters that require grad (the adapter); the
    frozen base comes from `model.path` again on resume."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = {
        "backend": "fsdp",
        "trainable_only": trainable_only,
        "step": step,
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }
    if trainable_only:  # tied weights (lm_head = embeddings) are reported even though frozen
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        state["model"] = {k: v for k, v in state["model"].items() if k in trainable}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    with atomic_step_dir(output_dir, step, keep=keep) as tmp:
        if _is_rank0():
            write_state(tmp / STATE_FILE, state)


def load_checkpoint(path: Path, *, model, optimizer, scheduler, trainable_only: bool = False) -> int:
    """Restore every rank from `path`; returns the next step to train. A checkpoint of the other kind
    (adapter-only vs full) is refused with a ValueError naming both."""
    state = read_state(path, backend="fsdp")
    saved_kind = bool(state.get("trainable_only", False))
    if saved_kind != trainable_only:
        kinds = {True: "LoRA adapter-only", False: "full-weight"}
        raise ValueError(
            f"checkpoint {path} is {kinds[saved_kind]} but this trainer is {kinds[trainable_only]}: "
            "resume with the lora setting the run was started with"
        )
    options = StateDictOptions(full_state_dict=True, strict=not trainable_only)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    logger.info("resumed from %s (next step %d)", path, state["step"])
    return int(state["step"])
