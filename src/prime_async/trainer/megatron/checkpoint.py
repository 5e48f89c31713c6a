"""Megatron backend checkpoints: sharded model + distributed-optimizer state with
`megatron.core.dist_checkpointing`, in the directory protocol of `trainer/ckpt.py`.

    checkpoints/trainer/step_{n}/
        megatron/     dist_checkpointing (torch_dist): model and optimizer shards, written by every rank
        trainer.pt    backend, step, torch RNG, model path and the layout it was saved at (rank 0)
        COMPLETE      written last, by `atomic_step_dir`

Invariants:
- layout-free: the optimizer state uses megatron's `fully_reshardable` format and the model's sharded
  tensors carry global offsets, so a checkpoint saved at one TP/PP/DP layout loads at another
  (`tests/megatron/test_megatron_checkpoint.py` saves at TP=1 and resumes at TP=2);
- resuming is exact: a resumed step equals the uninterrupted one (same weights, Adam moments and step
  count, learning rate from the step, torch RNG);
- the data position is the step: the next batch the trainer asks the orchestrator for is `step`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu

from prime_async.trainer.ckpt import STATE_FILE, atomic_step_dir, read_state, write_state

logger = logging.getLogger(__name__)

DIST_DIR = "megatron"
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def save_megatron_checkpoint(
    *, model, optimizer, output_dir: Path, step: int, keep: int | None, model_path: str, layout: dict
) -> None:
    """Collective: every rank writes its shards; rank 0 writes `trainer.pt`."""
    model_state = model.sharded_state_dict()
    sharded = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, metadata=SHARDING),
    }
    with atomic_step_dir(output_dir, step, keep=keep, subdirs=(DIST_DIR,)) as tmp:
        dist_checkpointing.save(sharded, str(tmp / DIST_DIR))
        if torch.distributed.get_rank() == 0:
            state = {
                "backend": "megatron",
                "step": step,
                "rng": torch.get_rng_state(),
                "model_path": str(Path(model_path).resolve()),
                "layout": layout,
            }
            write_state(tmp / STATE_FILE, state)


def load_megatron_checkpoint(path: Path, *, model, optimizer) -> int:
    """Restore every rank from `path` (any layout); returns the next step to train."""
    state = read_state(path, backend="megatron")
    for opt in _distributed_optimizers(optimizer):
        _prepare_for_load(opt)
    model_state = model.sharded_state_dict()
    sharded = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=SHARDING),
    }
    loaded = dist_checkpointing.load(sharded, str(Path(path) / DIST_DIR))
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    for opt in _distributed_optimizers(optimizer):
        _unshare_steps(opt)
    torch.set_rng_state(state["rng"])
    logger.info(
        "resumed from %s (next step %d; saved at %s, loaded at tp=%d pp=%d dp=%d)",
        path,
        state["step"],
        state.get("layout"),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_data_parallel_world_size(),
    )
    return int(state["step"])


def load_model_shards(path: Path, model) -> None:
    """Only the model part of checkpoint `path` into `model` (the HF export needs no optimizer)."""
    read_state(path, backend="megatron")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(Path(path) / DIST_DIR))
    model.load_state_dict(loaded["model"])


def _distributed_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _prepare_for_load(opt) -> None:
    """Allocate the optimizer state the checkpoint is loaded into, and keep torch Adam's `step`.

    megatron-core 0.16's `fully_reshardable` load skips torch Adam's per-parameter `step` in the source
    and then copies every destination key (KeyError 'step') when neither apex nor TransformerEngine
    provides the optimizer (CPU ranks); the step is restored from the common state before that copy, so
    the copy keeps it. The dummy state's zero-gradient step is overwritten by the load.
    """
    if not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
        return
    opt._init_optimizer_states_with_dummy_values()
    if getattr(opt, "_keeps_adam_step", False):  # installed by an earlier load of this optimizer
        return
    opt._keeps_adam_step = True
    copy_states = opt._set_main_param_and_optimizer_states

    def keep_step(model_param, tensors):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
        step = opt.optimizer.state.get(main_param, {}).get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step.clone()}
        copy_states(model_param, tensors)

    opt._set_main_param_and_optimizer_states = keep_step


def _unshare_steps(opt) -> None:
    """Give every parameter its own torch Adam `step` tensor again.

    Without apex/TransformerEngine, megatron-core 0.16's `load_state_dict` assigns one step tensor to
    every parameter's state; torch Adam then increments that one tensor once per parameter per step, and
    the bias correction of the next steps goes wrong (the resumed step differed from the uninterrupted one
    by ~25% of an update before this)."""
    inner = getattr(opt, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
