"""Projections of the embedded engine's forward: `y = x @ W.T + b` with `W` kept in the layout the
fastest kernel for the device reads.

Used by `inference/model_runner.py`, which builds one `Projection` per fused weight after every weight
load. On CPU with oneDNN (`kernels = "packed"`), the weight is also reordered once into oneDNN's blocked
layout, and calls with more than `DENSE_MAX_ROWS` rows run oneDNN's inner-product kernel on it: MKL's
sgemm (what `F.linear` calls) re-packs the whole weight on every call, which at decode batch sizes (a
handful of rows) costs about as much as the multiply itself; with one or two rows MKL takes its
matrix-vector path, which beats both, so those stay on `F.linear`. A weight under `PACK_MIN_ELEMENTS`
is not packed: a oneDNN call costs ~50 us of fixed overhead, more than such a matrix takes (it stays in
cache between steps; the tiny test model is all such weights). Elsewhere (`kernels = "dense"`, CUDA, no
oneDNN, a dtype oneDNN lacks) it is plain `F.linear`. The packed copy costs one more copy of the weights
in memory.

Invariants:
- both layouts compute the same fp32 (or bf16) inner products; results differ from `F.linear` only by
  summation order (a few ulp);
- the packed copy is made from the given tensor at construction, so a later in-place change of that
  tensor is not seen (the runner rebuilds every projection after a weight load);
- inputs are 2-D and contiguous (the runner passes (tokens, features) activations).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Kernels = Literal["packed", "dense"]

# oneDNN picks its blocked layout for a typical row count; measured equal for 8 and 64 on SmolLM2 shapes
_PACK_BATCH_HINT = 16
# at most this many rows: MKL's matrix-vector path on the dense weight is faster (1 thread, SmolLM2)
DENSE_MAX_ROWS = 2
# smaller weights stay dense (measured: packed loses below ~0.3M elements, wins from ~1M, 1 thread)
PACK_MIN_ELEMENTS = 2**18
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `kernels = "packed"` uses oneDNN here (CPU build with oneDNN, fp32/bf16 weights)."""
    return (
        device.type == "cpu"
        and dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


class Projection:
    """One weight matrix (out, in) plus optional bias, callable on (N, in) activations -> (N, out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, kernels: Kernels) -> None:
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        big = weight.numel() >= PACK_MIN_ELEMENTS
        if kernels == "packed" and big and packing_available(weight.device, weight.dtype):
            dense = weight.detach().contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, _PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > DENSE_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
