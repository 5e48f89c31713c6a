"""`needs_devices(n)`: tests that start n trainer ranks, one CUDA device each when CUDA is visible.

On CUDA rank r of a trainer uses `cuda:r` (`trainer/train.py` refuses more ranks than visible devices), so
such a test cannot pass on a machine with fewer devices: it is skipped, the reason naming both counts.
Without CUDA the ranks run on the CPU and the test runs. Applied in `tests/conftest.py` at collection.
"""

from __future__ import annotations


def cuda_device_count() -> int:
    """CUDA devices visible to the test session (0 without CUDA or without torch)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def device_skip_reason(needed: int, visible: int) -> str | None:
    """Why a test needing `needed` devices is skipped with `visible` CUDA devices (None: it runs)."""
    if visible == 0 or needed <= visible:
        return None
    return f"needs {needed} CUDA devices, {visible} visible"
