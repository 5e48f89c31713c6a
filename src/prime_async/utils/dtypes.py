"""Model parameter dtype from its config name (`model.dtype`, the engine's `dtype`): one rule for all loaders.

"auto" is bfloat16 on CUDA and float32 elsewhere (CPU bfloat16 matmuls are slow and the tests compare
float32 numerics); "float32" and "bfloat16" are what they name. Used by the FSDP and megatron trainer
backends and the torch inference engine, so trainer and engine agree on what "auto" means.
"""

from __future__ import annotations

import torch

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype for `name` on `device`; an unknown name raises one line listing the known ones."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _NAMED:
        raise ValueError(f"unknown model dtype {name!r}: expected one of auto, {', '.join(_NAMED)}")
    return _NAMED[name]
