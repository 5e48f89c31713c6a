"""Batch building: group-relative advantages, then packing samples into micro-batches per trainer rank.

    groups ──advantages──► samples ──first-fit-decreasing into rows of <= seq_len──► rows
    rows ──longest-first onto the rank with fewest tokens──► TrainBatch.micro_batches[rank]

Invariants:
- advantage of an episode = reward - mean(rewards of its seat in the group) (divided by std + eps when
  `std_normalize`), written on its loss tokens, 0.0 elsewhere: each seat of a multi-agent env is its
  own baseline (the seats of one game play different roles with different reward scales); a
  single-agent group is one seat, so this is the plain group-relative advantage;
- every sample is whole inside one micro-batch of <= seq_len tokens and `position_ids` restart at 0 at
  each sample (the sink already truncated or dropped longer episodes);
- every rank gets the same number of micro-batches (FSDP ranks must run the same number of steps): a rank
  short of rows gets 1-token padding rows with loss_mask False;
- `num_loss_tokens` counts loss tokens over all ranks; `min_dispatch_version` is the oldest group's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.orchestrator.types import Episode, Group
from prime_async.transport.types import MicroBatch, TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    episode: Episode
    advantage: float

    @property
    def num_tokens(self) -> int:
        return len(self.episode.token_ids)


def group_advantages(rewards: list[float], cfg: AdvantageConfig) -> list[float]:
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if cfg.std_normalize:
        adv = adv / (r.std() + cfg.eps)
    return [float(a) for a in adv]


def seat_advantages(group: Group, cfg: AdvantageConfig) -> list[float]:
    """Advantages of `group.episodes`, each relative to the episodes of the same seat."""
    out = [0.0] * len(group.episodes)
    rewards = group.rewards
    for indices in group.seats().values():
        for i, adv in zip(indices, group_advantages([rewards[i] for i in indices], cfg), strict=True):
            out[i] = adv
    return out


def _pack_rows(samples: list[_Sample], seq_len: int) -> list[list[_Sample]]:
    """First-fit decreasing: few rows, each of <= seq_len tokens."""
    rows: list[list[_Sample]] = []
    free: list[int] = []
    for sample in sorted(samples, key=lambda s: s.num_tokens, reverse=True):
        assert sample.num_tokens <= seq_len, f"sample of {sample.num_tokens} tokens > seq_len {seq_len}"
        for i, room in enumerate(free):
            if sample.num_tokens <= room:
                rows[i].append(sample)
                free[i] -= sample.num_tokens
                break
        else:
            rows.append([sample])
            free.append(seq_len - sample.num_tokens)
    return rows


def _row_to_micro_batch(row: list[_Sample]) -> MicroBatch:
    input_ids, positions, mask, adv, logp, versions = [], [], [], [], [], []
    for s in row:
        ep = s.episode
        n = len(ep.token_ids)
        input_ids.extend(ep.token_ids)
        positions.extend(range(n))
        mask.extend(ep.loss_mask)
        adv.extend(s.advantage if m else 0.0 for m in ep.loss_mask)
        logp.extend(lp if m else 0.0 for lp, m in zip(ep.sampler_logprobs, ep.loss_mask, strict=True))
        versions.extend(v if m else -1 for v, m in zip(ep.token_versions, ep.loss_mask, strict=True))
    return MicroBatch(
        input_ids=np.asarray(input_ids, dtype=np.int32),
        position_ids=np.asarray(positions, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.bool_),
        advantages=np.asarray(adv, dtype=np.float32),
        sampler_logprobs=np.asarray(logp, dtype=np.float32),
        token_versions=np.asarray(versions, dtype=np.int32),
    )


def _padding_micro_batch() -> MicroBatch:
    return MicroBatch(
        input_ids=np.zeros(1, dtype=np.int32),
        position_ids=np.zeros(1, dtype=np.int32),
        loss_mask=np.zeros(1, dtype=np.bool_),
        advantages=np.zeros(1, dtype=np.float32),
        sampler_logprobs=np.zeros(1, dtype=np.float32),
        token_versions=np.full(1, -1, dtype=np.int32),
    )


def _balance(rows: list[list[_Sample]], num_ranks: int) -> list[list[list[_Sample]]]:
    """Longest rows first onto the rank with the fewest tokens (LPT), ties to the fewest rows."""
    per_rank: list[list[list[_Sample]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for row in sorted(rows, key=lambda r: sum(s.num_tokens for s in r), reverse=True):
        rank = min(range(num_ranks), key=lambda i: (load[i], len(per_rank[i])))
        per_rank[rank].append(row)
        load[rank] += sum(s.num_tokens for s in row)
    return per_rank


def build_train_batch(
    groups: list[Group],
    *,
    step: int,
    seq_len: int,
    num_ranks: int,
    temperature: float,
    advantage_cfg: AdvantageConfig,
) -> TrainBatch:
    """Turn the groups of one batch cut into the TrainBatch of trainer step `step`."""
    assert groups, "build_train_batch needs at least one group"
    samples: list[_Sample] = []
    for group in groups:
        for ep, adv in zip(group.episodes, seat_advantages(group, advantage_cfg), strict=True):
            samples.append(_Sample(ep, adv))
    per_rank = _balance(_pack_rows(samples, seq_len), num_ranks)
    num_rows = max(len(rows) for rows in per_rank)
    micro_batches = [
        [_row_to_micro_batch(r) for r in rows] + [_padding_micro_batch() for _ in range(num_rows - len(rows))]
        for rows in per_rank
    ]
    return TrainBatch(
        step=step,
        micro_batches=micro_batches,
        num_loss_tokens=sum(mb.num_loss_tokens for rank in micro_batches for mb in rank),
        temperature=temperature,
        min_dispatch_version=min(g.dispatch_version for g in groups),
        max_dispatch_version=max(g.dispatch_version for g in groups),
    )
