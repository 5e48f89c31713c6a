"""Batch building: group-relative advantages, then packing samples into micro-batches per trainer rank.

    groups ──advantages──► samples ──per seat: shared prompt + branches──► units
    units ──first-fit-decreasing into rows of <= seq_len──► rows
    rows ──longest-first onto the rank with fewest tokens──► TrainBatch.micro_batches[rank]

Shared prefixes (`share_prefix`): the episodes of one seat of a group start with the same prompt tokens.
A unit packs them as the first episode whole, then every other episode as a *branch*: only its tokens
from position S on, with `position_ids` continuing at S (see `transport/types.py` for the row layout), so
the trainer runs the S shared tokens once instead of once per episode. S is the longest common prefix,
cut so that every branch starts with a non-loss token (its first loss token is then predicted inside
the branch, from context that includes the shared tokens).

Invariants:
- advantage of an episode = reward - mean(rewards of its seat in the group) (divided by std + eps when
  `std_normalize`), written on its loss tokens, 0.0 elsewhere: each seat of a multi-agent env is its
  own baseline (the seats of one game play different roles with different reward scales); a
  single-agent group is one seat, so this is the plain group-relative advantage;
- every sample is whole inside one micro-batch of <= seq_len tokens (a branch together with the sample
  that holds its shared prefix); `position_ids` restart at 0 at each unshared sample and continue at S at
  each branch (the sink already truncated or dropped longer episodes);
- a branch's first token is never a loss token, and its S shared tokens equal the first S tokens of the
  unit's first sample;
- every rank gets the same number of micro-batches (FSDP ranks must run the same number of steps): a rank
  short of rows gets padding rows (`MicroBatch.padding`: no loss token);
- `num_loss_tokens` counts loss tokens over all ranks; `min_dispatch_version` is the oldest group's, or
  with `max_off_policy_steps` given the oldest version a loss token of the batch may have (a straggler
  whose tokens older than K the sink masked counts as `step - K`, `token_staleness.py`);
- an episode's images travel in the row that holds its tokens (`MicroBatch.images`, row offsets), each
  image once: a shared prefix never ends inside an image nor past an image that differs between the
  episodes (equal placeholder tokens do not mean equal images), so a prefix image is the first sample's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from prime_async.config.orchestrator import AdvantageConfig, TeacherConfig
from prime_async.orchestrator.token_staleness import oldest_trained_version
from prime_async.orchestrator.types import Group
from prime_async.rollouts.images import image_bytes
from prime_async.rollouts.types import Episode
from prime_async.transport.packing import balance_rows, pack_rows
from prime_async.transport.types import MicroBatch, RowImage, TrainBatch

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


@dataclass
class _Unit:
    """Samples packed next to each other in one row: the first whole, each later one from token `shared`
    on (a branch; `shared` = 0: every sample whole)."""

    samples: list[_Sample]
    shared: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples) - self.shared * (len(self.samples) - 1)


def shared_prefix_length(episodes: list[Episode]) -> int:
    """S: the first S tokens of every episode are equal, and token S of each is not a loss token (each
    branch starts with a context token), and every episode is longer than S. 0 when under two episodes."""
    if len(episodes) < 2:
        return 0
    first = np.asarray(episodes[0].token_ids)
    limit = min(len(ep.token_ids) for ep in episodes) - 1
    for ep in episodes:
        mask = np.asarray(ep.loss_mask, dtype=np.bool_)
        loss_at = np.flatnonzero(mask)
        limit = min(limit, int(loss_at[0]) - 1 if loss_at.size else limit)
        ids = np.asarray(ep.token_ids[: limit + 1])
        differ = np.flatnonzero(ids != first[: ids.shape[0]])
        if differ.size:
            limit = min(limit, int(differ[0]))
    return max(min(limit, _image_cut(episodes, limit)), 0)


def _image_cut(episodes: list[Episode], limit: int) -> int:
    """The longest prefix <= `limit` that ends neither inside an image nor past one that differs from the
    first episode's image at the same place."""
    first = {im.offset: im.url for im in episodes[0].images}
    for ep in episodes:
        for im in ep.images:
            if im.offset >= limit:
                break
            if im.offset + im.length > limit or first.get(im.offset) != im.url:
                limit = im.offset
                break
    return limit


def _group_units(samples: list[_Sample], seq_len: int, share_prefix: bool) -> list[_Unit]:
    """One seat's samples of one group -> units of <= seq_len tokens (shared prefix when it saves)."""
    shared = shared_prefix_length([s.episode for s in samples]) if share_prefix else 0
    if shared == 0:
        return [_Unit([s]) for s in samples]
    units: list[_Unit] = []
    for sample in sorted(samples, key=lambda s: s.num_tokens, reverse=True):
        if units and units[-1].num_tokens + sample.num_tokens - shared <= seq_len:
            units[-1].samples.append(sample)
        else:
            units.append(_Unit([sample], shared))
    return units


def _row_to_micro_batch(row: list[_Unit], with_teacher: bool = False) -> MicroBatch:
    input_ids, positions, mask, adv, logp, versions, teacher = [], [], [], [], [], [], []
    routes = _row_routes(row)
    images = _row_images(row)
    for unit in row:
        for i, s in enumerate(unit.samples):
            ep, start = s.episode, (unit.shared if i else 0)
            loss = ep.loss_mask[start:]
            input_ids.extend(ep.token_ids[start:])
            positions.extend(range(start, len(ep.token_ids)))
            mask.extend(loss)
            adv.extend(s.advantage if m else 0.0 for m in loss)
            logp.extend(lp if m else 0.0 for lp, m in zip(ep.sampler_logprobs[start:], loss, strict=True))
            versions.extend(v if m else -1 for v, m in zip(ep.token_versions[start:], loss, strict=True))
            if ep.teacher_logprobs is not None:
                teacher.extend(ep.teacher_logprobs[start:])
            else:  # errored episodes carry no loss token
                teacher.extend([0.0] * len(loss))
    return MicroBatch(
        input_ids=np.asarray(input_ids, dtype=np.int32),
        position_ids=np.asarray(positions, dtype=np.int32),
        loss_mask=np.asarray(mask, dtype=np.bool_),
        advantages=np.asarray(adv, dtype=np.float32),
        sampler_logprobs=np.asarray(logp, dtype=np.float32),
        token_versions=np.asarray(versions, dtype=np.int32),
        routed_experts=routes,
        teacher_logprobs=np.asarray(teacher, dtype=np.float32) if with_teacher else None,
        images=images,
    )


def _row_images(row: list[_Unit]) -> list[RowImage]:
    """The images of a row's samples at their row offsets, in token order; a branch's images inside its
    shared prefix are its block's first sample's (not repeated)."""
    out: list[RowImage] = []
    at = 0  # where the sample's first packed token lands in the row
    for unit in row:
        for i, s in enumerate(unit.samples):
            ep, start = s.episode, (unit.shared if i else 0)
            for im in ep.images:
                if im.offset >= start:
                    data = image_bytes(im.url)
                    out.append(RowImage(at + im.offset - start, im.length, im.grid_thw, data))
            at += len(ep.token_ids) - start
    return out


def _row_routes(row: list[_Unit]) -> np.ndarray | None:
    """The routed experts of a row's tokens in packing order (MoE routing replay), -1 for an episode
    without them; None when no episode of the row has any."""
    samples = [(s.episode, unit.shared if i else 0) for unit in row for i, s in enumerate(unit.samples)]
    widths = {ep.routed_experts.shape[1] for ep, _ in samples if ep.routed_experts is not None}
    if not widths:
        return None
    (width,) = widths
    parts = [
        ep.routed_experts[start:]
        if ep.routed_experts is not None
        else np.full((len(ep.token_ids) - start, width), -1, dtype=np.int16)
        for ep, start in samples
    ]
    return np.concatenate(parts).astype(np.int16, copy=False)


def build_train_batch(
    groups: list[Group],
    *,
    step: int,
    seq_len: int,
    num_ranks: int,
    temperature: float,
    advantage_cfg: AdvantageConfig,
    share_prefix: bool = False,
    teacher: TeacherConfig | None = None,
    max_off_policy_steps: int | None = None,
) -> TrainBatch:
    """Turn the groups of one batch cut into the TrainBatch of trainer step `step`; `share_prefix`: pack
    each seat's episodes of a group as one shared prefix plus branches; `teacher` (on-policy distillation):
    environment advantages scaled by its `env_weight`, rows carry the teacher's logprobs, the batch its
    `kl_weight`, and `opd/reverse_kl` is the mean of sampler - teacher logprob over the loss tokens."""
    assert groups, "build_train_batch needs at least one group"
    units: list[_Unit] = []
    for group in groups:
        advantages = seat_advantages(group, advantage_cfg)
        if teacher is not None:
            advantages = [a * teacher.env_weight for a in advantages]
        for indices in group.seats().values():
            samples = [_Sample(group.episodes[i], advantages[i]) for i in indices]
            units.extend(_group_units(samples, seq_len, share_prefix))
    per_rank = balance_rows(pack_rows(units, seq_len), num_ranks)
    num_rows = max(len(rows) for rows in per_rank)
    micro_batches = [
        [_row_to_micro_batch(r, teacher is not None) for r in rows]
        + [MicroBatch.padding() for _ in range(num_rows - len(rows))]
        for rows in per_rank
    ]
    sample_tokens = sum(s.num_tokens for u in units for s in u.samples)
    packed_tokens = sum(u.num_tokens for u in units)
    metrics = {"batch/sample_tokens": float(sample_tokens), "batch/packed_tokens": float(packed_tokens)}
    metrics.update(advantage_metrics(micro_batches))
    if teacher is not None:
        metrics.update(reverse_kl_metrics(micro_batches))
    return TrainBatch(
        metrics=metrics,
        teacher_kl_weight=teacher.kl_weight if teacher is not None else 0.0,
        step=step,
        micro_batches=micro_batches,
        num_loss_tokens=sum(mb.num_loss_tokens for rank in micro_batches for mb in rank),
        temperature=temperature,
        min_dispatch_version=min(_oldest_version(g, step, max_off_policy_steps) for g in groups),
        max_dispatch_version=max(g.dispatch_version for g in groups),
    )


def _oldest_version(group: Group, step: int, max_off_policy_steps: int | None) -> int:
    if max_off_policy_steps is None:
        return group.dispatch_version
    return oldest_trained_version(group, step, max_off_policy_steps)


def advantage_metrics(micro_batches: list[list[MicroBatch]]) -> dict[str, float]:
    """`batch/advantage/{mean,abs_mean}`: the advantage's mean and mean magnitude over the batch's loss
    tokens (what the loss weighs; group-relative advantages have mean 0 per group, not per token)."""
    values = [mb.advantages[mb.loss_mask.astype(bool)] for rank in micro_batches for mb in rank]
    flat = np.concatenate(values) if values else np.zeros(0, dtype=np.float32)
    if flat.size == 0:
        return {}
    return {
        "batch/advantage/mean": float(flat.mean()),
        "batch/advantage/abs_mean": float(np.abs(flat).mean()),
    }


def reverse_kl_metrics(micro_batches: list[list[MicroBatch]]) -> dict[str, float]:
    """`opd/reverse_kl`: mean over the batch's loss tokens of sampler - teacher logprob, the sample estimate
    of KL(student || teacher) along the student's trajectories; `opd/teacher_logprob` its teacher side."""
    diffs, teacher = [], []
    for mb in (mb for rank in micro_batches for mb in rank):
        if mb.teacher_logprobs is not None and mb.loss_mask.any():
            diffs.append((mb.sampler_logprobs - mb.teacher_logprobs)[mb.loss_mask])
            teacher.append(mb.teacher_logprobs[mb.loss_mask])
    if not diffs:
        return {"opd/reverse_kl": 0.0, "opd/teacher_logprob": 0.0}
    return {
        "opd/reverse_kl": float(np.concatenate(diffs).mean()),
        "opd/teacher_logprob": float(np.concatenate(teacher).mean()),
    }
