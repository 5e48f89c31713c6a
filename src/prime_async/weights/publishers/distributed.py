"""`weights.transport = "distributed"`: versions held in memory, sent over a torch.distributed group
(trainer rank 0 + every engine) when the orchestrator asks (`weights/loaders/distributed.py`).

    publish(n): snapshot (a CPU copy, the newest `snapshots_to_keep` held), bucket plan; on disk only at
                checkpoint steps and the last step (restarts load from there) ──► Published(n, buckets)
    control thread, on the orchestrator's requests:
        JoinGroup   ──► join the weight process group as rank 0 (leaving an older one), reply done
        SendWeights ──► ack (version held) or refuse; broadcast every bucket in order; reply done

Invariants: the buckets sent are the ones announced in `Published` (same names, dtypes, shapes, order);
the broadcasts run on the control thread, so training goes on meanwhile (a separate group: no
collective of the training group is involved).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from prime_async.config.trainer import TrainerConfig
from prime_async.weights.control import VERSION_GONE, ControlRequest, JoinGroup, Reply, SendWeights
from prime_async.weights.process_group import (
    join_weight_group,
    leave_weight_group,
    metas_of,
    plan_buckets,
    resolve_backend,
    send_bucket,
)
from prime_async.weights.publishers.base import (
    ControlledPublisher,
    Weights,
    snapshot,
    snapshots_to_keep,
    without_tied_head,
)
from prime_async.weights.tensor_meta import TensorMeta
from prime_async.weights.writer import BroadcastWriter

logger = logging.getLogger(__name__)


class DistributedPublisher(ControlledPublisher):
    """Full weights over the weight process group (see the module docstring)."""

    transport = "distributed"

    def __init__(self, cfg: TrainerConfig, writer: BroadcastWriter, device: torch.device, *, tied: bool):
        self.keep_snapshots = snapshots_to_keep(cfg)
        self._snapshots: OrderedDict[int, tuple[dict[str, torch.Tensor], list[list[TensorMeta]]]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self._group: dist.ProcessGroup | None = None
        self._group_backend = "gloo"
        super().__init__(cfg, writer, device, tied=tied)  # last: the control thread may call answer()

    def publish(self, weights: Weights, version: int, *, protected: Iterable[int], on_disk: bool) -> None:
        tensors = without_tied_head(snapshot(weights.tensors), self.tied)
        buckets = plan_buckets(metas_of(tensors), int(self.cfg.weights.bucket_mb * 2**20))
        with self._lock:
            self._snapshots[version] = (tensors, buckets)
            while len(self._snapshots) > self.keep_snapshots:
                self._snapshots.popitem(last=False)
        if on_disk:
            self.writer.publish(tensors, version, protected=protected)
        self.announce(version, buckets=buckets)

    def close(self) -> None:
        super().close()
        if self._group is not None:
            leave_weight_group(self._group)
            self._group = None

    def answer(self, msg: ControlRequest, reply: Callable[[Reply], None]) -> Reply | None:
        if isinstance(msg, JoinGroup):
            self._join(msg)
        elif isinstance(msg, SendWeights):
            self._send(msg, reply)
        else:
            return super().answer(msg, reply)
        return None

    def _join(self, msg: JoinGroup) -> None:
        backend = resolve_backend(msg.backend, self.device)
        if self._group is not None:
            leave_weight_group(self._group)
            self._group = None
        logger.info("joining weight process group %s (%s, world size %d) as rank 0 on %s:%d",
                    msg.group_name, backend, msg.world_size, msg.master_address, msg.master_port)  # fmt: skip
        self._group = join_weight_group(
            backend=backend, master_address=msg.master_address, master_port=msg.master_port, rank=0,
            world_size=msg.world_size, group_name=msg.group_name,
            timeout_s=min(self.cfg.weights.join_timeout_s, self.cfg.weights.timeout_s),
        )  # fmt: skip
        self._group_backend = backend

    def _send(self, msg: SendWeights, reply: Callable[[Reply], None]) -> None:
        with self._lock:
            held = self._snapshots.get(msg.version)
            versions = list(self._snapshots)
        if held is None or self._group is None:
            why = "no weight process group joined" if self._group is None else f"{VERSION_GONE}: {versions}"
            raise ValueError(f"cannot send version {msg.version}: {why}")
        reply(Reply(msg.request_id, True, "ack"))
        tensors, buckets = held
        device = self.device if self._group_backend == "nccl" else torch.device("cpu")
        for bucket in buckets:
            send_bucket(self._group, tensors, bucket, device)
        logger.info("sent weights v%d in %d bucket(s)", msg.version, len(buckets))
