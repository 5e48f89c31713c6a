"""Apply activation checkpointing, torch.compile and FSDP2 `fully_shard`, in that order (torchtitan's order).

Called once by `trainer/train.py` after the model is loaded. Pure: it only transforms the given module.
Invariants: parameter names (state-dict keys) are unchanged, so published weights load into plain HF
models; under FSDP2 every decoder layer is its own shard group and the root module holds the rest
(embeddings and the tied LM head stay in one group, so weight tying survives sharding).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for path in ("model.layers", "model.language_model.layers"):  # a causal LM's, a VLM's decoder
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has no `model.layers`: cannot parallelize per layer")


def parallelize(
    model: torch.nn.Module,
    *,
    activation_checkpointing: bool,
    compile: bool,
    dp_mesh=None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Return `model` with AC, compile and (when `dp_mesh` is given) FSDP2 applied in that order."""
    layers = _decoder_layers(model)
    if activation_checkpointing:
        # HF's own non-reentrant checkpointing keeps parameter names intact (checkpoint_wrapper renames them).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        for layer in layers:
            layer.compile()
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model
