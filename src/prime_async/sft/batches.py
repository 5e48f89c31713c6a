"""SFT batches by step: the trainer loop asks `receive(n)` exactly as it asks the orchestrator's stream.

    rendered examples ──epoch e: shuffled with seed + e──► step n takes positions [n*B, (n+1)*B)
        ──pack_rows (seq_len) + balance_rows (ranks)──► TrainBatch ──► this rank's RankBatch

Invariants: batch n is a pure function of (examples, batch_size, shuffle_seed, seq_len, world size, n), so
a resumed run (step = the checkpoint's) trains exactly the batches the uninterrupted run would (the data
position is the step); every example is seen once per epoch; examples longer than `seq_len` or without a
trained token are left out at start, counted in one warning; trained tokens carry advantage 1, sampler
logprob 0 and version -1 (the SFT loss reads only the mask).
"""

from __future__ import annotations

import logging
import random

import numpy as np

from prime_async.sft.render import Rendered
from prime_async.transport.packing import balance_rows, pack_rows
from prime_async.transport.types import MicroBatch, TrainBatch
from prime_async.transport.zmq_batches import RankBatch

logger = logging.getLogger(__name__)


def usable_examples(examples: list[Rendered], seq_len: int) -> list[Rendered]:
    """Examples that fit `seq_len` and train at least one token; one warning counts the others."""
    kept = [ex for ex in examples if ex.num_tokens <= seq_len and any(ex.loss_mask)]
    too_long = sum(ex.num_tokens > seq_len for ex in examples)
    if len(kept) < len(examples):
        left_out = len(examples) - len(kept)
        logger.warning("sft: %d of %d examples left out (%d longer than seq_len = %d, the rest without a "
                       "trained token)", left_out, len(examples), too_long, seq_len)  # fmt: skip
    if not kept:
        raise ValueError(f"sft: no example fits seq_len = {seq_len} with a trained token")
    return kept


def micro_batch(row: list[Rendered]) -> MicroBatch:
    ids = np.concatenate([np.asarray(ex.token_ids, dtype=np.int32) for ex in row])
    mask = np.concatenate([np.asarray(ex.loss_mask, dtype=np.bool_) for ex in row])
    return MicroBatch(
        input_ids=ids,
        position_ids=np.concatenate([np.arange(ex.num_tokens, dtype=np.int32) for ex in row]),
        loss_mask=mask,
        advantages=mask.astype(np.float32),
        sampler_logprobs=np.zeros(ids.shape[0], dtype=np.float32),
        token_versions=np.full(ids.shape[0], -1, dtype=np.int32),
    )


class SFTBatches:
    """Batch source of the SFT trainer (the `BatchReceiver` interface: `receive(step)`, `close()`)."""

    def __init__(
        self,
        examples: list[Rendered],
        *,
        batch_size: int,
        seed: int,
        seq_len: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.examples, self.batch_size, self.seed = examples, batch_size, seed
        self.seq_len, self.rank, self.world_size = seq_len, rank, world_size
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            random.Random(self.seed + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is enough: steps only move forward
        return self._orders[epoch]

    def step_examples(self, step: int) -> list[Rendered]:
        n = len(self.examples)
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        return [self.examples[self._order(p // n)[p % n]] for p in positions]

    def epoch_of(self, step: int) -> float:
        return (step + 1) * self.batch_size / len(self.examples)

    def train_batch(self, step: int) -> TrainBatch:
        chosen = self.step_examples(step)
        per_rank = balance_rows(pack_rows(chosen, self.seq_len), self.world_size)
        num_rows = max(len(rows) for rows in per_rank)
        micro_batches = [
            [micro_batch(r) for r in rows] + [MicroBatch.padding() for _ in range(num_rows - len(rows))]
            for rows in per_rank
        ]
        tokens = sum(ex.num_tokens for ex in chosen)
        return TrainBatch(
            step=step, micro_batches=micro_batches,
            num_loss_tokens=sum(mb.num_loss_tokens for rank in micro_batches for mb in rank),
            temperature=1.0, min_dispatch_version=step, max_dispatch_version=step,
            metrics={"batch/sample_tokens": float(tokens)},
        )  # fmt: skip

    def receive(self, step: int) -> RankBatch:
        return RankBatch.of(self.train_batch(step), self.rank)

    def close(self) -> None:
        pass
