"""Packed micro-batch rows <-> right-padded megatron batches.

Why unpack: megatron-core's GPTModel derives RoPE positions from the sequence index (it ignores
`position_ids`), and packed-sequence attention (`PackedSeqParams`, THD) needs TransformerEngine. So a packed
row of several samples is split at its sample starts (`packed_rows.sample_starts`) into a (B, S) batch,
right-padded, run with a causal mask, and the logits are gathered back into the packed order. With right
padding and a causal mask no real token attends to padding or to another sample. A branch (a sample that
continues the first P tokens of its block's first sample) is expanded back: its batch row holds those P
shared tokens, then its own; only its own tokens map back to the packed order (no compute is saved here,
the rows stay correct).

Invariants: `pack_logits(unpack(row)) ` returns exactly one row of logits per packed token, in order;
S is a multiple of `seq_multiple` (tensor parallel size under sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prime_async.trainer.packed_rows import sample_starts
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
    """[start, end) of every packed sample (branches included), split at `packed_rows.sample_starts`."""
    starts = np.flatnonzero(sample_starts(np.asarray(position_ids))).tolist()
    ends = [*starts[1:], int(position_ids.shape[0])]
    return list(zip(starts, ends, strict=True))


def _prefix_starts(position_ids: np.ndarray, bounds: list[tuple[int, int]]) -> list[int]:
    """For each sample, the packed index its shared tokens start at (its block's first sample)."""
    out, block_start = [], 0
    for start, _ in bounds:
        if int(position_ids[start]) == 0:
            block_start = start
        out.append(block_start)
    return out


def unpack(mb: MicroBatch, *, seq_multiple: int = 1, device: torch.device | str = "cpu") -> PaddedBatch:
    """Split a packed row at its sample starts into a right-padded (B, S) batch (branches expanded)."""
    positions_np = np.asarray(mb.position_ids)
    bounds = sample_bounds(positions_np)
    shared = [int(positions_np[start]) for start, _ in bounds]  # 0, or a branch's P shared tokens
    longest = max(p + end - start for p, (start, end) in zip(shared, bounds, strict=True))
    seq = -(-longest // seq_multiple) * seq_multiple
    ids = torch.zeros(len(bounds), seq, dtype=torch.long)
    rows = torch.empty(mb.num_tokens, dtype=torch.long)
    cols = torch.empty(mb.num_tokens, dtype=torch.long)
    src = torch.from_numpy(mb.input_ids.astype(np.int64))
    prefix_at = _prefix_starts(positions_np, bounds)
    for b, ((start, end), p, first) in enumerate(zip(bounds, shared, prefix_at, strict=True)):
        ids[b, :p] = src[first : first + p]
        ids[b, p : p + end - start] = src[start:end]
        rows[start:end] = b
        cols[start:end] = torch.arange(p, p + end - start)
    positions = torch.arange(seq).expand(len(bounds), seq)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    return PaddedBatch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        attention_mask=causal.to(device),
        rows=rows.to(device),
        cols=cols.to(device),
    )


def pad_to(batch: PaddedBatch, rows: int, seq: int) -> PaddedBatch:
    """`batch` grown to (rows, seq) with padding tokens (id 0) that no packed token maps to. Used where
    every rank of a group must run the same shape (megatron's allgather MoE dispatcher)."""
    b, s = batch.input_ids.shape
    if (b, s) == (rows, seq):
        return batch
    device = batch.input_ids.device
    ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
    ids[:b, :s] = batch.input_ids
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    positions = torch.arange(seq, device=device).expand(rows, seq)
    return PaddedBatch(ids, positions, causal, batch.rows, batch.cols)


def pack_logits(logits_bsv: torch.Tensor, batch: PaddedBatch, vocab_size: int) -> torch.Tensor:
    """(B, S, V_padded) -> (T, V): packed order, vocabulary padding dropped."""
    return logits_bsv[batch.rows, batch.cols, :vocab_size]
