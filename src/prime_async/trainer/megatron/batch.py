"""Packed micro-batch rows <-> right-padded megatron batches.

Why unpack: megatron-core's GPTModel derives RoPE positions from the sequence index (it ignores
`position_ids`), and packed-sequence attention (`PackedSeqParams`, THD) needs TransformerEngine. So a packed
row of several samples (`position_ids` restarting at 0) is split at those restarts into a (B, S) batch,
right-padded, run with a causal mask, and the logits are gathered back into the packed order. With right
padding and a causal mask no real token attends to padding or to another sample.

Invariants: `pack_logits(unpack(row)) ` returns exactly one row of logits per packed token, in order;
S is a multiple of `seq_multiple` (tensor parallel size under sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prime_async.transport.types import MicroBatch


@dataclass
class PaddedBatch:
    """One packed row as a right-padded (B, S) batch plus the map back to the packed order."""

    input_ids: torch.Tensor  # (B, S) int64
    position_ids: torch.Tensor  # (B, S) int64
    attention_mask: torch.Tensor  # (1, 1, S, S) bool, True = masked (megatron convention)
    rows: torch.Tensor  # (T,) row of packed token t
    cols: torch.Tensor  # (T,) column of packed token t


def sample_bounds(position_ids: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every packed sample: a sample starts where position_ids is 0 (and at index 0)."""
    starts = np.flatnonzero(position_ids == 0).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], int(position_ids.shape[0])]
    return list(zip(starts, ends, strict=True))


def unpack(mb: MicroBatch, *, seq_multiple: int = 1, device: torch.device | str = "cpu") -> PaddedBatch:
    """Split a packed row at its sample starts into a right-padded (B, S) batch."""
    bounds = sample_bounds(mb.position_ids)
    longest = max(end - start for start, end in bounds)
    seq = -(-longest // seq_multiple) * seq_multiple
    ids = torch.zeros(len(bounds), seq, dtype=torch.long)
    rows = torch.empty(mb.num_tokens, dtype=torch.long)
    cols = torch.empty(mb.num_tokens, dtype=torch.long)
    src = torch.from_numpy(mb.input_ids.astype(np.int64))
    for b, (start, end) in enumerate(bounds):
        ids[b, : end - start] = src[start:end]
        rows[start:end] = b
        cols[start:end] = torch.arange(end - start)
    positions = torch.arange(seq).expand(len(bounds), seq)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return PaddedBatch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        attention_mask=causal.to(device),
        rows=rows.to(device),
        cols=cols.to(device),
    )


def pack_logits(logits_bsv: torch.Tensor, batch: PaddedBatch, vocab_size: int) -> torch.Tensor:
    """(B, S, V_padded) -> (T, V): packed order, vocabulary padding dropped."""
    return logits_bsv[batch.rows, batch.cols, :vocab_size]
