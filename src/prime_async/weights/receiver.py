"""The embedded engine's end of weight-update groups (SGLang's `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`).

    POST /init_weights_update_group  ──► join(...)     blocks (in a worker thread) until every rank joined
    POST /update_weights_from_distributed ──► receive(bucket) in a worker thread ──► Engine.load_tensors
    POST /destroy_weights_update_group ──► leave(name)

Invariants: the engine's rank in a group is `rank_offset` (one engine = one rank, as SGLang with tp 1);
receives on one group run one at a time in arrival order (the broadcasts of rank 0 are ordered); a bucket
is always received completely before it is validated, so a refused bucket (unknown name, wrong shape)
never leaves rank 0 blocked in its broadcast; the event loop never blocks on a collective.
"""

from __future__ import annotations

import asyncio
import logging

import torch
import torch.distributed as dist

from prime_async.weights.process_group import join_weight_group, leave_weight_group, receive_bucket
from prime_async.weights.tensor_meta import TensorMeta

logger = logging.getLogger(__name__)


class WeightReceiver:
    """Weight-update groups this engine joined, by name."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def join(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str,
    ) -> None:  # fmt: skip
        """Join `group_name` as rank `rank_offset`; replaces a group of the same name (a rejoin)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: the embedded engine joins with 'gloo' or 'nccl'")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA engine: use 'gloo' on CPU")
        if not 1 <= rank_offset < world_size:
            raise ValueError(f"rank_offset {rank_offset} outside [1, world_size {world_size})")
        if group_name in self._groups:
            self.leave(group_name)
        pg = await asyncio.to_thread(
            join_weight_group, backend=backend, master_address=master_address, master_port=master_port,
            rank=rank_offset, world_size=world_size, group_name=group_name,
        )  # fmt: skip
        self._groups[group_name] = pg
        self._locks[group_name] = asyncio.Lock()
        logger.info(
            "joined weight process group %s as rank %d of %d (%s)",
            group_name,
            rank_offset,
            world_size,
            backend,
        )

    def leave(self, group_name: str) -> bool:
        """Destroy `group_name`; False when this engine is not in it."""
        pg = self._groups.pop(group_name, None)
        self._locks.pop(group_name, None)
        if pg is None:
            return False
        leave_weight_group(pg)
        logger.info("left weight process group %s", group_name)
        return True

    def leave_all(self) -> None:
        for name in list(self._groups):
            self.leave(name)

    async def receive(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> dict[str, torch.Tensor]:
        """Receive one bucket from rank 0 of `group_name` (CPU or the engine's device)."""
        if group_name not in self._groups:
            raise ValueError(
                f"group {group_name!r} not initialized (joined: {sorted(self._groups)}): "
                "call /init_weights_update_group first"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names ({len(names)}), dtypes ({len(dtypes)}), shapes ({len(shapes)}) differ in length"
            )
        bucket = [TensorMeta(n, d, list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        async with self._locks[group_name]:
            return await asyncio.to_thread(receive_bucket, self._groups[group_name], bucket, self.device)
