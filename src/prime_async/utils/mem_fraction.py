"""A process's stated share of its GPU (`trainer.runtime.mem_fraction`, `inference.engine.mem_fraction`).

When trainer and engine share one GPU (`weights.transport = "shared"`), each states its share and `rl`
checks at start that the shares sum to at most 1 (`config/interactions.py`). On CUDA the share caps the
process's caching allocator (`torch.cuda.set_per_process_memory_fraction`): an allocation beyond it
fails with an out-of-memory error in that process instead of starving the other one. On CPU nothing is
capped (the config check alone applies).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def apply_mem_fraction(fraction: float | None, device: torch.device | str, *, who: str) -> bool:
    """Cap this process's allocations on `device` to `fraction` of its memory (CUDA only; None: no cap).
    Returns whether a cap was set."""
    device = torch.device(device)
    if fraction is None or device.type != "cuda":
        return False
    if not 0 < fraction <= 1:
        raise ValueError(f"{who}: mem_fraction {fraction} outside (0, 1]")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    logger.info("%s: allocations on cuda:%d capped at %.0f%% of its memory", who, index, 100 * fraction)
    return True
