"""`weights.transport = "filesystem"`: every version written to `broadcasts/step_N/` (+ STABLE), then
announced; the engines load it with `/update_weights_from_disk` (`weights/loaders/filesystem.py`).

    publish(n): wait for v(n-1) to be written (raise its error), snapshot (a copy) ──► writer thread:
                BroadcastWriter writes broadcasts/step_n/ (+ STABLE) ──► Published(n)

Invariants: versions are written on one writer thread in version order, at most one at a time, so
training step n + 1 overlaps the write of n and memory holds at most one extra copy of the weights;
`flush()` (before a checkpoint, at the end of the run) leaves nothing unwritten; only versions a restart
may load (`on_disk`: checkpoint steps, the last step) are fsynced: the engines read the others through
the page cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from prime_async.config.trainer import TrainerConfig
from prime_async.weights.publishers.base import ControlledPublisher, Weights, snapshot
from prime_async.weights.writer import BroadcastWriter

logger = logging.getLogger(__name__)


class FilesystemPublisher(ControlledPublisher):
    """Full weights through the broadcast directory, written in the background (see the module docstring)."""

    transport = "filesystem"

    def __init__(self, cfg: TrainerConfig, writer: BroadcastWriter, device: torch.device, *, tied: bool):
        super().__init__(cfg, writer, device, tied=tied)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-writer")
        self._pending: Future | None = None  # the version being written, if any

    def publish(self, weights: Weights, version: int, *, protected: Iterable[int], on_disk: bool) -> None:
        self.flush()
        tensors = snapshot(weights.tensors)
        self._pending = self._writer.submit(self._write, tensors, version, list(protected), on_disk)

    def _write(self, tensors: dict[str, torch.Tensor], version: int, protected: list[int], durable: bool):
        """Writer thread: the version directory, then its announcement."""
        start = time.perf_counter()
        self.writer.publish(tensors, version, protected=protected, durable=durable)
        self.announce(version)
        self.last_write_s = time.perf_counter() - start

    def flush(self) -> None:
        """Wait until the version being written is written and announced; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the version being written (its error is logged: `flush` is where errors surface), then
        stop the control channel."""
        try:
            self.flush()
        except Exception:
            logger.exception("publishing the last weight version failed")
        self._writer.shutdown(wait=True)
        super().close()
