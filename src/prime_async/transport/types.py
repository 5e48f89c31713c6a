"""In-memory training-batch types shared by the orchestrator (producer) and the trainer (consumer).

The wire encoding lives in `transport/wire.py` (msgspec header + raw array frames, never pickle).

Invariants:
- every array of a `MicroBatch` has the same length T <= seq_len;
- row layout: `position_ids` restart at 0 at every packed sample, so attention never crosses samples;
  a *branch* is a sample whose positions start at S > 0 instead: it continues the first S tokens of the
  last sample that started at 0 (its block's first sample, whose first S tokens equal the branch's own
  first S, which are not repeated), and sees those S tokens plus its own (the orchestrator packs a
  group's common prompt this way, `orchestrator/batching.py`; `trainer/packed_rows.py` reads it);
- a sample's (or branch's) first token is never a loss token;
- `loss_mask` is True exactly on sampled completion tokens (never prompt, tool, user or template tokens);
- `sampler_logprobs` are the logprobs recorded at sampling time (0.0 where `loss_mask` is False);
- `token_versions` hold the weight version each token was sampled under (-1 where unknown / not sampled).
- `routed_experts` (MoE routing replay, else None) is (T, layers * k) int16: row t holds the experts token
  t was routed to by the engine, layer-major, -1 where unknown (the trainer routes those itself).
- `teacher_logprobs` (on-policy distillation, else None) is (T,) float32: the teacher's logprob of token t
  given the tokens before it, at the sampling temperature, on loss tokens (0.0 elsewhere); a batch
  carries it on every row iff its `teacher_kl_weight` > 0.
- `images` (a vision-language model's rows) are in token order, each whole inside the row: its
  `length` placeholder tokens from `offset` on are the model's image token, and no two overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ARRAY_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "position_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float32),
    "sampler_logprobs": np.dtype(np.float32),
    "token_versions": np.dtype(np.int32),
}


ROUTES_DTYPE = np.dtype(np.int16)


@dataclass(frozen=True)
class RowImage:
    """One image of a packed row: its placeholder tokens `[offset, offset + length)` in the row, the
    image processor's `(t, h, w)` patch grid, and the encoded image file (PNG, JPEG, ...) as the
    environment gave it; the trainer turns it into pixel values with the model's image processor."""

    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    data: bytes


PADDING_TOKENS = 2


@dataclass
class MicroBatch:
    """One packed row of several samples, flat per-token arrays of shape (T,)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    sampler_logprobs: np.ndarray
    token_versions: np.ndarray
    routed_experts: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None
    images: list[RowImage] = field(default_factory=list)

    @classmethod
    def padding(cls) -> MicroBatch:
        """The padding row: two tokens (a sample and its successor), no loss token. A rank short of rows
        runs it so collectives stay in step; it adds nothing to the loss or its normalizer. Built here
        only (the orchestrator pads batches with it, the trainer pads its ranks with it)."""
        return cls(
            input_ids=np.zeros(PADDING_TOKENS, dtype=np.int32),
            position_ids=np.arange(PADDING_TOKENS, dtype=np.int32),
            loss_mask=np.zeros(PADDING_TOKENS, dtype=np.bool_),
            advantages=np.zeros(PADDING_TOKENS, dtype=np.float32),
            sampler_logprobs=np.zeros(PADDING_TOKENS, dtype=np.float32),
            token_versions=np.full(PADDING_TOKENS, -1, dtype=np.int32),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def routes_or_unknown(self, width: int) -> np.ndarray:
        """`routed_experts`, or all -1 (unknown) of `width` when the row has none (padding rows)."""
        if self.routed_experts is not None:
            return np.ascontiguousarray(self.routed_experts, dtype=ROUTES_DTYPE)
        return np.full((self.num_tokens, width), -1, dtype=ROUTES_DTYPE)

    def teacher_or_zeros(self) -> np.ndarray:
        """`teacher_logprobs`, or zeros (padding rows, which have no loss token)."""
        if self.teacher_logprobs is not None:
            return np.ascontiguousarray(self.teacher_logprobs, dtype=np.float32)
        return np.zeros(self.num_tokens, dtype=np.float32)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    """Batch for trainer step `step`: one list of micro-batches per data-parallel rank.

    `num_loss_tokens` counts loss tokens over the whole batch (all ranks): the loss normalizer.
    `min_dispatch_version` is the oldest dispatch version of any group in it, so the trainer can
    re-check `step - min_dispatch_version <= max_off_policy_steps` (defence in depth; the train
    sink's sweep is the guarantee).
    """

    step: int
    micro_batches: list[list[MicroBatch]]
    num_loss_tokens: int
    temperature: float
    min_dispatch_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    max_dispatch_version: int = -1  # newest group's (-1 = unknown): the trainer refuses one > step
    teacher_kl_weight: float = 0.0  # on-policy distillation: > 0 iff every row carries teacher_logprobs
