"""A spy on a model's forward that checks every tensor it is fed is on the model's parameters' device.

`spy_inputs(model)` wraps `model.forward` (an instance attribute: `model(...)`, and DDP/FSDP wrappers
calling `module(...)`, go through it). Each call checks every tensor argument's device against
`model_device(model)` and raises `AssertionError` naming the argument and both devices. With
`stop=True` a call that passed raises `InputsOnDevice` instead of running the model: the model may then
be on the meta device, which is how a CPU test catches an input left on the CPU (a CUDA model would fail
the same way, in a GPU run).
"""

from __future__ import annotations

import torch

from prime_async.utils.devices import model_device


class InputsOnDevice(Exception):  # a signal that the check passed, not an error
    """Raised by a `stop=True` spy after the inputs of a call were checked."""


def spy_inputs(model: torch.nn.Module, *, stop: bool = False) -> list[dict[str, torch.device]]:
    """Install the spy; returns the list each call appends its {argument: device} to."""
    forward = model.forward
    calls: list[dict[str, torch.device]] = []

    def checked(*args, **kwargs):
        want = model_device(model)
        named = {f"arg{i}": a for i, a in enumerate(args)} | kwargs
        devices = {k: v.device for k, v in named.items() if isinstance(v, torch.Tensor)}
        calls.append(devices)
        wrong = {k: str(d) for k, d in devices.items() if d != want}
        assert not wrong, f"{type(model).__name__} on {want} fed tensors on {wrong}"
        if stop:
            raise InputsOnDevice(devices)
        return forward(*args, **kwargs)

    model.forward = checked
    return calls
