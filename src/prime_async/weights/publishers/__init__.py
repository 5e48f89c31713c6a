"""The trainer side of the weight transports: one `WeightPublisher` per transport, one per file.

    build_publisher(cfg, writer, device, tied) ──► LoraAdapterPublisher   (`lora` set: only the adapter)
                                                   FilesystemPublisher    (weights.transport = "filesystem")
                                                   DistributedPublisher   ("distributed")
                                                   SharedPublisher        ("shared")

Adding a transport: one file here (a `ControlledPublisher` subclass), one entry in `PUBLISHERS`, one
value of `WeightTransport` (`prime_async/types.py`), and its loader in `weights/loaders/`.
"""

from __future__ import annotations

import torch

from prime_async.config.trainer import TrainerConfig
from prime_async.types import WeightTransport
from prime_async.weights.publishers.base import ControlledPublisher, WeightPublisher, Weights
from prime_async.weights.publishers.distributed import DistributedPublisher
from prime_async.weights.publishers.filesystem import FilesystemPublisher
from prime_async.weights.publishers.lora import LoraAdapterPublisher
from prime_async.weights.publishers.shared import SharedPublisher
from prime_async.weights.writer import BroadcastWriter

__all__ = ["PUBLISHERS", "WeightPublisher", "Weights", "build_publisher"]

PUBLISHERS: dict[WeightTransport, type[ControlledPublisher]] = {
    "filesystem": FilesystemPublisher,
    "distributed": DistributedPublisher,
    "shared": SharedPublisher,
}


def build_publisher(
    cfg: TrainerConfig, writer: BroadcastWriter, device: torch.device, *, tied: bool
) -> WeightPublisher:
    """Trainer rank 0's publisher for `cfg` (its control channel connects at once)."""
    cls = LoraAdapterPublisher if cfg.lora is not None else PUBLISHERS[cfg.weights.transport]
    return cls(cfg, writer, device, tied=tied)
