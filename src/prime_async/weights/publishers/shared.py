"""`weights.transport = "shared"`: versions copied into shared memory (`weights/shared_memory.py`) and
lent to the engines on request, no process group (`weights/loaders/shared.py`).

    publish(n): copy into shared memory (the newest `snapshots_to_keep` held); on disk only at checkpoint
                steps and the last step (restarts load from there) ──► Published(n)
    control thread, on the orchestrator's requests:
        Lend    ──► reply done with one SharedVersion per engine (the version stays held), or refuse
        GiveBack ──► the lent version may be dropped again; reply done

Invariants: a lent version is kept until it is given back (or the next Lend), so no engine copies from
memory the trainer freed; the copy is made at `publish` (never a view of the parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from prime_async.config.trainer import TrainerConfig
from prime_async.weights.control import ControlRequest, GiveBack, Lend, Reply
from prime_async.weights.publishers.base import (
    ControlledPublisher,
    Weights,
    snapshot,
    snapshots_to_keep,
    without_tied_head,
)
from prime_async.weights.shared_memory import SharedStore
from prime_async.weights.writer import BroadcastWriter


class SharedPublisher(ControlledPublisher):
    """Full weights lent from shared memory (see the module docstring)."""

    transport = "shared"

    def __init__(self, cfg: TrainerConfig, writer: BroadcastWriter, device: torch.device, *, tied: bool):
        self.keep_snapshots = snapshots_to_keep(cfg)
        self.store = SharedStore(device, self.keep_snapshots)
        super().__init__(cfg, writer, device, tied=tied)  # last: the control thread may call answer()

    def publish(self, weights: Weights, version: int, *, protected: Iterable[int], on_disk: bool) -> None:
        state = without_tied_head(weights.tensors, self.tied)
        self.store.put(state, version)
        if on_disk:
            self.writer.publish(snapshot(state), version, protected=protected)
        self.announce(version)

    def close(self) -> None:
        super().close()
        self.store.close()

    def answer(self, msg: ControlRequest, reply: Callable[[Reply], None]) -> Reply | None:
        if isinstance(msg, Lend):
            return Reply(msg.request_id, True, "done", shares=self.store.lend(msg.version, msg.copies))
        if isinstance(msg, GiveBack):
            self.store.give_back(msg.version)
            return None
        return super().answer(msg, reply)
