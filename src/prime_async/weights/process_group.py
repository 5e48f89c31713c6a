"""Weights over torch.distributed: the weight-update process group and its tensor protocol.

One module for both ends, so that they agree byte for byte with SGLang's own implementation:

    trainer rank 0 (rank 0 of the group)             engine ranks 1 .. world_size - 1
      join_weight_group(rank=0) ─── TCPStore at master_address:master_port ───► join_weight_group(rank=k)
      send_bucket(tensors)      ─── one broadcast per tensor, src = 0, in order ──► receive_bucket(metas)

- `join_weight_group` follows SGLang's `init_custom_process_group` (rendezvous over
  `tcp://master_address:master_port`, a `PrefixStore(group_name)`, `_new_process_group_helper`), so a real
  SGLang server (`/init_weights_update_group`) and the embedded engine join the same group the trainer
  creates. Rank 0 hosts the store. Backends: gloo (CPU tensors), nccl (CUDA tensors).
- A bucket is what one `/update_weights_from_distributed` call carries: `names`, `dtypes`, `shapes`
  (SGLang's payload); its tensors travel as one broadcast each, in that order (SGLang's default
  `load_format`). `plan_buckets` bounds a bucket's bytes (a single tensor larger than the bound is a bucket
  of its own), so neither end holds more than one bucket of staging memory beyond the weights.
- dtype names are torch's attribute names without the `torch.` prefix ("float32", "bfloat16"), as SGLang
  resolves them (`getattr(torch, name)`; `tensor_meta.py`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from prime_async.weights.tensor_meta import TensorMeta, dtype_name, dtype_of

GroupBackend = Literal["gloo", "nccl"]


def resolve_backend(backend: str, device: torch.device | str) -> GroupBackend:
    """`auto` -> nccl on CUDA, gloo on CPU; an explicit choice must fit the device."""
    is_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return "nccl" if is_cuda else "gloo"
    if backend == "nccl" and not is_cuda:
        raise ValueError("weights.backend = 'nccl' needs CUDA tensors: use 'gloo' (or 'auto') on CPU")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight process group backend {backend!r}: expected 'gloo', 'nccl' or 'auto'")
    return backend  # type: ignore[return-value]


def join_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: create) the weight-update process group; blocks until all `world_size` ranks joined.

    Does not need (nor touch) the default process group: a torchrun trainer joins with its rank 0 only."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(
            f"weight process group: rank {rank} of world size {world_size} (needs 0 <= rank < size >= 2)"
        )
    if not group_name:
        raise ValueError("weight process group: group_name is empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(
        rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_weight_group(pg: dist.ProcessGroup) -> None:
    dist.destroy_process_group(pg)


def metas_of(state: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name, dtype_name(t.dtype), list(t.shape)) for name, t in state.items()]


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive runs of `metas` of at most `bucket_bytes` each (an oversized tensor goes alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size {bucket_bytes} bytes: must be >= 1")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        if current and size + meta.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def send_bucket(
    pg: dist.ProcessGroup,
    state: Mapping[str, torch.Tensor],
    bucket: Sequence[TensorMeta],
    device: torch.device,
) -> None:
    """Rank 0: broadcast the bucket's tensors in order (copied to `device` one at a time)."""
    for meta in bucket:
        tensor = state[meta.name]
        if dtype_name(tensor.dtype) != meta.dtype or list(tensor.shape) != meta.shape:
            raise ValueError(f"{meta.name}: tensor {tensor.dtype} {list(tensor.shape)} does not match {meta}")
        dist.broadcast(tensor.to(device).contiguous(), src=0, group=pg)


def receive_bucket(
    pg: dist.ProcessGroup, bucket: Sequence[TensorMeta], device: torch.device
) -> dict[str, torch.Tensor]:
    """Engine rank: receive the bucket's tensors (same order as `send_bucket`)."""
    tensors = {
        meta.name: torch.empty(meta.shape, dtype=dtype_of(meta.dtype), device=device) for meta in bucket
    }
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors.values()]
    for handle in handles:
        handle.wait()
    return tensors
