"""Where a model's inputs go, and how many CUDA devices this process sees: one rule for every caller.

`model_device(model)` is the device of the model's parameters. Every tensor built on the host and fed to a
model (ids, positions, masks, the loss's inputs) is placed there, by the code that feeds the model and not by
whoever called it: under megatron-core's DDP a model's parameters live where DDP put its buffers
(`torch.cuda.current_device()`), which need not be the device the caller asked for.

`cuda_device_count()` is what the trainer's refusal of more ranks than devices counts
(`trainer/train.py::check_ranks_fit_devices`).

Invariant: `model_device` raises (one line naming the devices) when the parameters are split over devices
or there are none, instead of guessing.
"""

from __future__ import annotations

import numpy as np
import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """The one device every parameter of `model` is on (FSDP2 DTensors report their local device)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        found = ", ".join(sorted(str(d) for d in devices)) or "none"
        raise ValueError(f"cannot place inputs for {type(model).__name__}: its parameters are on {found}")
    return devices.pop()


def on_model(model_or_device: torch.nn.Module | torch.device, data, dtype: torch.dtype | None = None):
    """`data` (a numpy array, a list or a tensor) as a tensor on the model's device (`dtype` if given)."""
    device = model_or_device if isinstance(model_or_device, torch.device) else model_device(model_or_device)
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(np.ascontiguousarray(data))
    elif not isinstance(data, torch.Tensor):
        data = torch.tensor(data, dtype=dtype)
    return data.to(device=device, dtype=dtype)


def cuda_device_count() -> int:
    """CUDA devices visible to this process (after CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
