"""Test-only shim: megatron-core 0.16.1 (local layer spec, gloo) on CPU. Never imported by product code.

Each piece is the smallest one found that works, and none changes numerics:
- `torch.cuda.current_device()` returns the CPU device: megatron-core allocates rotary frequencies, grad
  buffers and TP communication buffers on `torch.cuda.current_device()`.
- a `TorchFunctionMode` serves tensor factories called with `device="cuda"` (hard-coded in the pipeline
  schedules' token counter and the optimizer's overflow buffer) and `Tensor.cuda()` from the CPU, and makes
  `Tensor.type()` report `torch.cuda.*` names: megatron's optimizer and grad clipping assert
  `param.type() == "torch.cuda.FloatTensor"` as a plain string check.
- the RNG tracker is (re)initialised as an inference tracker: the default one snapshots CUDA RNG states.
  Dropout is 0 in every config the backend builds, so no randomness is lost.
With it, the product path itself (megatron DDP, distributed optimizer, forward/backward schedule, grad
finalisation) runs unchanged in the tests.
"""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode


class _CudaToCpu(TorchFunctionMode):
    """Serve `device="cuda"` tensor factories and `Tensor.cuda()` from the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizer asserts `param.type() == "torch.cuda.FloatTensor"` (a type check only).
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_MODE: _CudaToCpu | None = None


def apply_cpu_shim() -> None:
    """Redirect megatron-core's CUDA device queries to the CPU and install a CUDA-free RNG tracker."""
    global _MODE
    torch.set_num_threads(1)
    if _MODE is None:
        _MODE = _CudaToCpu()
        _MODE.__enter__()
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def init_gloo_single_process() -> None:
    """World size 1 process group on a free loopback port (idempotent)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
