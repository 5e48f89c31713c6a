"""Mini-batches of one batch (`optim.num_steps_per_batch`) and the off-policy distance of their tokens.

Both backends (`fsdp.py`, `megatron/backend.py`) train batch n as S = `num_steps_per_batch` optimizer
steps: `plan_mini_batches` splits the micro-batches a rank (FSDP) or replica (megatron) trains into S
chunks, and each chunk's loss is normalized by the loss tokens of that chunk on all ranks. The trainer loop
still publishes one version per batch (step n -> version n + 1, after the last mini-batch), and the LR
schedule counts batches, so every mini-batch of a batch uses the same LR.

Invariants:
- the split is contiguous and the same function of (number of micro-batches, S) everywhere: sizes differ
  by at most one, larger chunks first; with fewer micro-batches than S the trailing chunks are empty;
- the chunk token counts are summed over the data-parallel group, so every rank sees the same counts and
  skips the same mini-batches (those without loss tokens anywhere: no optimizer step, so Adam's momentum
  does not move the weights on a zero gradient); the counts must add up to the batch's `num_loss_tokens`;
- with S = 1 the plan is the whole list with the batch's `num_loss_tokens`, and no collective is run;
- `OffPolicyClock.distance`: a loss token sampled under version v and trained in batch n after j optimizer
  steps of that batch is (n - v) * S + j optimizer steps off-policy (version v holds v * S steps); a token
  whose version is unknown (-1) gets the batch's oldest dispatch version, an upper bound on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from prime_async.trainer.token_stats import reduce_device
from prime_async.transport.types import MicroBatch

T = TypeVar("T")


def split_mini_batches(items: list[T], num_steps: int) -> list[list[T]]:
    """`num_steps` contiguous chunks of `items`, sizes differing by at most one (larger first)."""
    if num_steps < 1:
        raise ValueError(f"num_steps_per_batch must be >= 1, got {num_steps}")
    base, extra = divmod(len(items), num_steps)
    chunks, start = [], 0
    for j in range(num_steps):
        size = base + (1 if j < extra else 0)
        chunks.append(items[start : start + size])
        start += size
    return chunks


def plan_mini_batches(
    micro_batches: list[MicroBatch],
    num_steps: int,
    *,
    num_loss_tokens: int,
    step: int,
    group: dist.ProcessGroup | None = None,
) -> list[tuple[list[MicroBatch], int]]:
    """(chunk, loss tokens of that chunk on every rank of `group`) per mini-batch; collective when S > 1."""
    if num_steps == 1:
        return [(list(micro_batches), num_loss_tokens)]
    chunks = split_mini_batches(list(micro_batches), num_steps)
    counts = torch.tensor([sum(mb.num_loss_tokens for mb in c) for c in chunks], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        counts = counts.to(reduce_device())
        dist.all_reduce(counts, group=group)
    totals = [int(c) for c in counts.cpu()]
    if sum(totals) != num_loss_tokens:
        raise ValueError(
            f"batch {step}: its micro-batches hold {sum(totals)} loss tokens, but num_loss_tokens = "
            f"{num_loss_tokens}"
        )
    return list(zip(chunks, totals, strict=True))


@dataclass(frozen=True)
class OffPolicyClock:
    """The effective off-policy distance (in optimizer steps) of the tokens of batch `step`."""

    step: int
    steps_per_batch: int
    fallback_version: int  # the batch's min dispatch version, for tokens without a version

    def distance(self, mb: MicroBatch, steps_taken: int) -> np.ndarray:
        """(T,) int64 distance of each token of `mb`, trained after `steps_taken` steps of this batch."""
        versions = np.where(mb.token_versions >= 0, mb.token_versions, self.fallback_version)
        return (self.step - versions.astype(np.int64)) * self.steps_per_batch + steps_taken
