"""What a tensor of a published version is on the wire: name, dtype name, shape (`TensorMeta`).

Shared by both ends of every transport: the control channel announces buckets of them (`control.py`),
the process group broadcasts tensors in their order (`process_group.py`), shared memory lays them out
(`shared_memory.py`). It imports no other weights module, so none of them forms a cycle through it.

Invariants: dtype names are torch's attribute names without the `torch.` prefix ("float32", "bfloat16"),
as SGLang resolves them (`getattr(torch, name)`); torch is imported only where a size or a dtype object
is needed (the orchestrator's filesystem path never loads torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch


class TensorMeta(msgspec.Struct, frozen=True):
    """Name, dtype name and shape of one HF tensor of a published version."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        import torch

        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=dtype_of(self.dtype)).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """`torch.<name>`; ValueError naming the bad value otherwise."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return dtype
