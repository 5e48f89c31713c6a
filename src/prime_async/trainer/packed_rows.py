"""Packed micro-batch rows as both backends train them: validation, per-token logprobs.

A row packs several samples (layout: `transport/types.py`). A sample starts at index 0 and wherever a
position is not the previous one + 1: at 0 (an unshared sample, or the first sample of a shared prefix)
or at S > 0 (a *branch*: it continues the first S tokens of the last sample that started at 0). A token
sees the earlier tokens of its own sample and, in a branch, the S shared tokens; the first token of a
sample or branch is predicted from no context of its own, so it never carries loss. Invariants:
- `logprobs_from_logits` is the one logits -> (logprob, entropy) definition, reached through
  `packed_logprobs` (FSDP: HF model) or `scatter_rows` (megatron: its own logits), so both backends train
  the same quantity;
- with a loss mask, logprobs and entropies are computed on loss tokens only (0 elsewhere): the vocab-sized
  LM head and softmax never run on prompt positions;
- `sample_starts` is the one definition of where a packed sample starts, the same one
  `megatron/batch.py::sample_bounds` splits rows at; `attention_mask` is the one definition of what a
  token sees (only built for rows with branches: other rows are plain restarts at 0, which HF masks
  from `position_ids` alone);
- a padding row (`MicroBatch.padding`) has no loss token: a rank (or replica) with fewer rows runs it
  to keep collectives in step.
"""

from __future__ import annotations

import numpy as np
import torch

from prime_async.transport.types import MicroBatch


def logprobs_from_logits(
    logits_nv: torch.Tensor, targets_n: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(logits / temperature)[target]` (N,) and the entropy (N,) of that distribution.

    Computed as `z[target] - logsumexp(z)`: no full-vocab log-softmax is part of the autograd graph (nor
    saved for backward); the entropy is a statistic, computed without gradient.
    """
    z = logits_nv.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets_n[:, None].long())[:, 0] - lse
    with torch.no_grad():  # -sum p log p (better conditioned than lse - sum p z at low entropy)
        logprobs_nv = z.detach() - lse.detach()[:, None]
        entropy = -torch.linalg.vecdot(logprobs_nv.exp(), logprobs_nv)
    return logp, entropy


def logit_rows(num_tokens: int, loss_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Positions whose logits are needed: t predicts token t + 1, so every t < T - 1, or (with
    `loss_mask`) only those whose next token is a loss token."""
    if loss_mask is None:
        return torch.arange(max(num_tokens - 1, 0), device=device)
    return torch.nonzero(loss_mask[1:], as_tuple=True)[0]


def packed_logprobs(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    loss_mask: torch.Tensor | None = None,
    vision: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob (T,) of each token under the model at `temperature`, and the entropy (T,) of the
    distribution it was sampled from; position 0 of the row (no predecessor) gets 0 for both.

    With `loss_mask`, only loss tokens get values (0 elsewhere) and the LM head runs only on the positions
    that predict them (HF's `logits_to_keep`): prompt positions cost no vocab-sized work. `vision`: a
    vision-language row's pixel values, grids and (4, 1, T) positions (`trainer/vision.py`).
    """
    rows = logit_rows(input_ids.shape[0], loss_mask, input_ids.device)
    logits = row_logits(model, input_ids, position_ids, rows, vision)
    return scatter_rows(logits, rows, input_ids, temperature)


def row_logits(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor,
    vision: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Forward of one packed row (T,) through an HF causal LM; logits (N, V) of positions `rows` only.
    A row with branches runs with its explicit (1, 1, T, T) mask (True = attend, SDPA's convention); a
    row with images gets `vision`'s inputs (its positions replace the plain ones)."""
    mask = None
    if has_branches(position_ids):
        mask = attention_mask(position_ids)[None, None]
    inputs = {"position_ids": position_ids[None], **(vision or {})}
    out = model(
        input_ids=input_ids[None], attention_mask=mask, use_cache=False, logits_to_keep=rows, **inputs
    )
    return out.logits[0]


def sample_starts(position_ids: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """(T,) bool: True where a packed sample starts (index 0, and every position that is not the
    previous one + 1: a restart at 0 or a branch's jump back to S)."""
    starts = position_ids[1:] != position_ids[:-1] + 1
    head = min(1, position_ids.shape[0])
    if isinstance(position_ids, np.ndarray):
        return np.concatenate([np.ones(head, dtype=np.bool_), starts])
    return torch.cat([torch.ones(head, dtype=torch.bool, device=position_ids.device), starts])


def has_branches(position_ids: torch.Tensor | np.ndarray) -> bool:
    """Whether some sample of the row starts at a position > 0 (continues a shared prefix)."""
    starts = sample_starts(position_ids)
    return bool((position_ids[starts] > 0).any())


def attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(T, T) bool, True where query token i may attend key token j: j <= i in the same sample, or j one
    of the S tokens a branch (starting at position S) shares with the first sample of its block."""
    pos = position_ids
    starts = sample_starts(pos)
    sample = torch.cumsum(starts.long(), 0) - 1
    block = torch.cumsum((pos == 0).long(), 0) - 1  # a block starts at position 0
    block.clamp_(min=0)
    start_pos = pos[starts][sample]  # position each token's sample starts at (0 or S)
    first_sample_of_block = sample[pos == 0]  # one entry per block, in order
    in_first = sample == first_sample_of_block[block]
    idx = torch.arange(pos.shape[0], device=pos.device)
    causal = idx[None, :] <= idx[:, None]
    same_sample = sample[:, None] == sample[None, :]
    shared = (block[:, None] == block[None, :]) & in_first[None, :] & (pos[None, :] < start_pos[:, None])
    return causal & (same_sample | shared)


def scatter_rows(
    logits_nv: torch.Tensor, rows: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) of the tokens after `rows`, placed at their own positions in (T,) tensors."""
    targets = rows + 1
    logp_n, entropy_n = logprobs_from_logits(logits_nv, input_ids[targets], temperature)
    zeros = torch.zeros(input_ids.shape[0], dtype=logp_n.dtype, device=logp_n.device)
    return zeros.scatter(0, targets, logp_n), zeros.scatter(0, targets, entropy_n)


def sample_ids(position_ids: np.ndarray) -> np.ndarray:
    """(T,) int64: index of each token's packed sample (branches included) in the row, counting from 0."""
    return np.cumsum(sample_starts(np.asarray(position_ids)), dtype=np.int64) - 1


def samples_with_loss(mb: MicroBatch) -> int:
    """Packed samples (branches included) of row `mb` holding at least one loss token: the trajectories
    the row trains, counted from its own position ids and loss mask (0 for a padding row)."""
    mask = np.asarray(mb.loss_mask, dtype=np.bool_)
    if not mask.any():
        return 0
    return int(np.unique(sample_ids(mb.position_ids)[mask]).size)


def check_micro_batch(mb: MicroBatch, seq_len: int, step: int) -> None:
    """Refuse a row longer than `seq_len`, with a loss token at a sample's first token, or with a branch
    that shares more tokens than the first sample of its block has (or has no such sample)."""
    if mb.num_tokens > seq_len:
        raise ValueError(f"batch {step}: micro-batch of {mb.num_tokens} tokens exceeds seq_len={seq_len}")
    starts = sample_starts(np.asarray(mb.position_ids))
    if bool((mb.loss_mask & starts).any()):
        raise ValueError(f"batch {step}: loss token at a sample's first token (it has no context)")
    first_len = 0  # length of the current block's first sample
    for start, end in zip(*_bounds(starts), strict=True):
        shared = int(mb.position_ids[start])
        if shared == 0:
            first_len = end - start
        elif shared > first_len:
            raise ValueError(
                f"batch {step}: branch at token {start} continues {shared} shared tokens, but its block's "
                f"first sample has {first_len}"
            )


def _bounds(starts: np.ndarray) -> tuple[list[int], list[int]]:
    begin = np.flatnonzero(starts).tolist()
    return begin, [*begin[1:], int(starts.shape[0])]
