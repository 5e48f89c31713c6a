"""Packed micro-batch rows as both backends train them: validation, the padding row, per-token logprobs.

A row packs several samples; `position_ids` restart at 0 per sample, and the token at a sample's first
position has no context, so it never carries loss. Invariants:
- `logprobs_from_logits` is the one logits -> (logprob, entropy) definition, reached through
  `packed_logprobs` (FSDP: HF model) or `scatter_rows` (megatron: its own logits), so both backends train
  the same quantity;
- with a loss mask, logprobs and entropies are computed on loss tokens only (0 elsewhere): the vocab-sized
  LM head and softmax never run on prompt positions;
- `sample_ids` is the one definition of where a packed sample starts (position_ids == 0, and index 0), the
  same one `megatron/batch.py::sample_bounds` splits rows at;
- the padding row has no loss token: a rank (or replica) with fewer rows runs it to keep collectives in step.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob (T,) of each token under the model at `temperature`, and the entropy (T,) of the
    distribution it was sampled from; position 0 of the row (no predecessor) gets 0 for both.

    With `loss_mask`, only loss tokens get values (0 elsewhere) and the LM head runs only on the positions
    that predict them (HF's `logits_to_keep`): prompt positions cost no vocab-sized work.
    """
    rows = logit_rows(input_ids.shape[0], loss_mask, input_ids.device)
    return scatter_rows(row_logits(model, input_ids, position_ids, rows), rows, input_ids, temperature)


def row_logits(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Forward of one packed row (T,) through an HF causal LM; logits (N, V) of positions `rows` only."""
    out = model(
        input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, logits_to_keep=rows
    )
    return out.logits[0]


def scatter_rows(
    logits_nv: torch.Tensor, rows: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) of the tokens after `rows`, placed at their own positions in (T,) tensors."""
    targets = rows + 1
    logp_n, entropy_n = logprobs_from_logits(logits_nv, input_ids[targets], temperature)
    zeros = torch.zeros(input_ids.shape[0], dtype=logp_n.dtype, device=logp_n.device)
    return zeros.scatter(0, targets, logp_n), zeros.scatter(0, targets, entropy_n)


def sample_ids(position_ids: np.ndarray) -> np.ndarray:
    """(T,) int64: index of each token's packed sample in the row, counting from 0."""
    starts = position_ids == 0
    if starts.shape[0]:
        starts[0] = True
    return np.cumsum(starts, dtype=np.int64) - 1


def padding_micro_batch() -> MicroBatch:
    """Two tokens, no loss token."""
    return MicroBatch(
        input_ids=np.zeros(2, dtype=np.int32),
        position_ids=np.arange(2, dtype=np.int32),
        loss_mask=np.zeros(2, dtype=np.bool_),
        advantages=np.zeros(2, dtype=np.float32),
        sampler_logprobs=np.zeros(2, dtype=np.float32),
        token_versions=np.full(2, -1, dtype=np.int32),
    )


def check_micro_batch(mb: MicroBatch, seq_len: int, step: int) -> None:
    """Refuse a row longer than `seq_len` or with a loss token at a sample's first position."""
    if mb.num_tokens > seq_len:
        raise ValueError(f"batch {step}: micro-batch of {mb.num_tokens} tokens exceeds seq_len={seq_len}")
    if bool((mb.loss_mask & (mb.position_ids == 0)).any()):
        raise ValueError(f"batch {step}: loss token at a sample's first position (it has no context)")
