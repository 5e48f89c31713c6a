"""Megatron-core (0.16, local layer spec) on CPU ranks over gloo: small runs, CI and checkpoint tests.

`MegatronBackend.from_config` calls `enable_cpu_ranks()` when the trainer has no CUDA device, so
`uv run rl @ configs/tiny/rl_megatron.toml` trains the tiny model on a laptop with the same code path as
on GPUs. Each piece is the smallest one found that works, and none changes numerics:
- `torch.cuda.current_device()` returns the CPU device: megatron-core allocates rotary frequencies, grad
  buffers and TP communication buffers on `torch.cuda.current_device()`;
- `torch.cuda.synchronize()` is a no-op: dist_checkpointing calls it before writing shards;
- a `TorchFunctionMode` serves tensor factories called with `device="cuda"` (hard-coded in the pipeline
  schedules' token counter and the optimizer's overflow buffer) and `Tensor.cuda()` from the CPU, and makes
  `Tensor.type()` report `torch.cuda.*` names: megatron's optimizer and grad clipping assert
  `param.type() == "torch.cuda.FloatTensor"` as a plain string check;
- the RNG tracker is (re)initialised as an inference tracker: the default one snapshots CUDA RNG states.
  Dropout is 0 in every config the backend builds, so no randomness is lost;
- `moe_utils.te_general_gemm` is defined as None: megatron-core 0.16's MoE router tests it but only
  defines it when TransformerEngine imports (NameError otherwise), so the router uses torch's matmul.

Invariant: never called in a process that has CUDA (`enable_cpu_ranks` refuses), so GPU runs are untouched.
The mode costs a Python call per torch function, which is why it is not installed for the fsdp backend.
"""

from __future__ import annotations

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


def enable_cpu_ranks() -> None:
    """Redirect megatron-core's CUDA device queries to the CPU and install a CUDA-free RNG tracker
    (idempotent). Raises RuntimeError when CUDA is available: GPU runs must not go through it."""
    global _MODE
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_ranks() is for processes without CUDA")
    if _MODE is None:
        _MODE = _CudaToCpu()
        _MODE.__enter__()
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
