"""What the trainer loop (`trainer/train.py`) needs of a training backend: the `TrainBackend` protocol.

Implementations: `trainer/fsdp.py::FsdpBackend` (HF model, FSDP2) and
`trainer/megatron/backend.py::MegatronBackend` (megatron-core GPTModel, TP/PP/DP). The loop owns
everything else (receiving batches, staleness checks, publishing versions, checkpoint cadence, metrics);
a backend owns its model and optimizer. This module imports no implementation, so neither imports the
other or the loop.

Contract, on every rank:
- `train_rank_batch(batch)` trains this process's share of batch `batch.step` (`optim.num_steps_per_batch`
  optimizer steps over the mini-batches of `trainer/mini_batches.py`; all ranks call it for the same step
  and take the same steps) and returns the step's metrics, already reduced over ranks;
- `pretrained_config()` is the HF config published beside the weights;
- `hf_state_dict()` is collective: the full HF-named weights on global rank 0 (other ranks may get None);
- `save_checkpoint` / `load_checkpoint` are collective; `load_checkpoint` returns the next step to train.
  Both write the directory protocol of `trainer/ckpt.py` (atomic `step_{n}`, `COMPLETE` last), so the
  loop's resume, restarts and rollback are the same for both backends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from prime_async.trainer.loss import LossFn
from prime_async.transport.zmq_batches import RankBatch


class TrainBackend(Protocol):
    loss_fn: LossFn
    """The loss of every micro-batch (built from `loss`; `sft` sets the NLL loss after construction)."""

    def pretrained_config(self) -> Any:
        """The transformers `PretrainedConfig` written with every published version."""
        ...

    def train_rank_batch(self, batch: RankBatch) -> dict[str, float]: ...

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None: ...

    def probe_logits(self, sequences: list[list[int]]) -> list[torch.Tensor] | None:
        """Logits (T, V) of every position of each sequence under the current parameters (collective:
        every rank calls it); None where the backend cannot (the weight probe is then skipped)."""
        ...

    def save_checkpoint(self, *, output_dir: Path, step: int, keep: int | None) -> None: ...

    def load_checkpoint(self, path: Path) -> int: ...
