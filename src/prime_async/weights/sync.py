"""Trainer rank 0's side of weight transfer: publish each version and announce it; serve broadcasts.

    Trainer.publish(n) ──► WeightSync.publish(state, n)
        filesystem:  snapshot (a copy), then on the writer thread: WeightPublisher writes
                     broadcasts/step_n/ (+ STABLE)                                  ──► Published(n)
        distributed: state kept in memory (the newest `snapshots_to_keep`), on disk only at
                     checkpoint steps and the last step (restarts load from there) ──► Published(n, buckets)
        shared:      state copied into shared memory (weights/shared_memory.py: the newest
                     `snapshots_to_keep`), on disk as for distributed                  ──► Published(n)
    control thread (weights/control.py), on the orchestrator's requests:
        JoinGroup   ──► join the weight process group as rank 0 (leaving an older one), reply done
        SendWeights ──► ack (version held) or refuse; broadcast every bucket in order; reply done
        Lend        ──► reply done with one SharedVersion per engine (the version stays held), or refuse
        GiveBack    ──► the lent version may be dropped again; reply done

Invariants: a version is announced only after it exists (STABLE written / snapshot stored); a snapshot
is a copy, never a view of parameters that later optimizer steps change; filesystem versions are written
on one writer thread in version order, at most one at a time: `publish(n + 1)` first waits until version
n is written and announced (and raises its error), so training step n + 1 overlaps the write of n, memory
holds at most one extra copy of the weights, and `flush()` (before a checkpoint, at the end of the run)
leaves nothing unwritten; only versions a restart may load (checkpoint steps, the last step) are fsynced
(`durable`): the engines read the others through the page cache; buckets are the ones
announced in `Published` (same names, dtypes, shapes, order); the broadcasts run on the control thread,
so training goes on meanwhile (a separate group: no collective of the training group is involved).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from prime_async.config.trainer import TrainerConfig
from prime_async.weights.control import (
    VERSION_GONE,
    ControlClient,
    ControlRequest,
    GiveBack,
    JoinGroup,
    Lend,
    Published,
    Reply,
    SendWeights,
    TensorMeta,
)
from prime_async.weights.process_group import (
    join_weight_group,
    leave_weight_group,
    metas_of,
    plan_buckets,
    resolve_backend,
    send_bucket,
)
from prime_async.weights.publish import WeightPublisher
from prime_async.weights.shared_memory import SharedStore

logger = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 2  # the newest and the one the orchestrator may still be loading


def snapshots_to_keep(cfg: TrainerConfig) -> int:
    """Versions held in memory for the distributed and shared transports. A deterministic run loads every
    version in turn and the trainer runs up to K + 1 versions ahead of the served one, so it keeps K + 1
    (that many copies of the weights: CPU, or the trainer's GPU for shared on CUDA); otherwise the
    orchestrator asks for the newest, and a version it asks for once two newer exist is refused and
    replaced by the newest (`WeightWatcher.update`)."""
    if cfg.deterministic:
        return max(KEEP_SNAPSHOTS, (cfg.max_off_policy_steps or 0) + 1)
    return KEEP_SNAPSHOTS


def _snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of `state` (never a view: the optimizer changes the parameters while it is written)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


class WeightSync:
    """Publishes versions by `cfg.weights.transport` and answers the orchestrator's control requests."""

    def __init__(self, cfg: TrainerConfig, publisher: WeightPublisher, device: torch.device, *, tied: bool):
        self.cfg, self.publisher, self.device, self.tied = cfg, publisher, device, tied
        self.distributed = cfg.weights.transport == "distributed"
        self.keep_snapshots = snapshots_to_keep(cfg)
        self.shared = SharedStore(device, self.keep_snapshots) if cfg.weights.transport == "shared" else None
        self._snapshots: OrderedDict[int, tuple[dict[str, torch.Tensor], list[list[TensorMeta]]]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self._group: dist.ProcessGroup | None = None
        self._group_backend = "gloo"
        port = cfg.weights.resolved_control_port(cfg.transport)
        self.control = ControlClient(cfg.transport.host, port, handler=self._handle, device=device.type)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-writer")
        self._pending: Future | None = None  # the filesystem version being written, if any
        self.last_write_s: float | None = None  # how long the last finished version took to write + announce

    def publish(
        self, state: dict[str, torch.Tensor], version: int, *, protected: Iterable[int], on_disk: bool
    ) -> None:
        """Make `version` available and announce it. `on_disk`: a restart may load this version
        (checkpoint or last step): distributed also writes the directory, filesystem fsyncs it."""
        if self.shared is not None:
            self._publish_shared(state, version, protected=protected, on_disk=on_disk)
            return
        if not self.distributed:
            self.flush()
            tensors = _snapshot(state)
            self._pending = self._writer.submit(self._write, tensors, version, list(protected), on_disk)
            return
        tensors = _snapshot(state)
        if self.tied:
            tensors.pop("lm_head.weight", None)  # engines tie it to the embedding, as from disk
        buckets = plan_buckets(metas_of(tensors), int(self.cfg.weights.bucket_mb * 2**20))
        with self._lock:
            self._snapshots[version] = (tensors, buckets)
            while len(self._snapshots) > self.keep_snapshots:
                self._snapshots.popitem(last=False)
        if on_disk:
            self.publisher.publish(tensors, version, protected=protected)
        self.control.publish(Published(version, "distributed", buckets))

    def _publish_shared(
        self, state: dict[str, torch.Tensor], version: int, *, protected: Iterable[int], on_disk: bool
    ) -> None:
        assert self.shared is not None
        if self.tied:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # as distributed
        self.shared.put(state, version)
        if on_disk:
            self.publisher.publish(_snapshot(state), version, protected=protected)
        self.control.publish(Published(version, "shared"))

    def _write(self, tensors: dict[str, torch.Tensor], version: int, protected: list[int], durable: bool):
        """Writer thread: the version directory, then its announcement."""
        start = time.perf_counter()
        self.publisher.publish(tensors, version, protected=protected, durable=durable)
        self.control.publish(Published(version, "filesystem"))
        self.last_write_s = time.perf_counter() - start

    def flush(self) -> None:
        """Wait until the version being written is written and announced; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def publish_adapter(
        self, config: dict, tensors: dict[str, torch.Tensor], version: int, *, protected: Iterable[int]
    ) -> None:
        """LoRA: write the adapter directory of `version` (filesystem only), then announce it."""
        self.publisher.publish_adapter(config, tensors, version, protected=protected)
        self.control.publish(Published(version, "filesystem"))

    def close(self) -> None:
        """Finish the version being written (its error is logged: `flush` is where errors surface), then
        stop the control channel."""
        try:
            self.flush()
        except Exception:
            logger.exception("publishing the last weight version failed")
        self._writer.shutdown(wait=True)
        self.control.close()
        if self.shared is not None:
            self.shared.close()
        if self._group is not None:
            leave_weight_group(self._group)
            self._group = None

    # ---- control thread ------------------------------------------------------------------------------
    def _handle(self, msg: ControlRequest, reply: Callable[[Reply], None]) -> None:
        try:
            if isinstance(msg, JoinGroup):
                self._join(msg)
            elif isinstance(msg, SendWeights):
                self._send(msg, reply)
            elif isinstance(msg, Lend | GiveBack):
                if self.shared is None:
                    raise ValueError(f"{type(msg).__name__}: the trainer's weights.transport is not 'shared'")
                if isinstance(msg, Lend):
                    shares = self.shared.lend(msg.version, msg.copies)
                    reply(Reply(msg.request_id, True, "done", shares=shares))
                    return
                self.shared.give_back(msg.version)
        except Exception as e:  # reported to the orchestrator, which fails the update loudly
            logger.exception("weight transfer request %s failed", type(msg).__name__)
            reply(Reply(msg.request_id, False, "done", f"{type(e).__name__}: {e}"))
            return
        reply(Reply(msg.request_id, True, "done"))

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
