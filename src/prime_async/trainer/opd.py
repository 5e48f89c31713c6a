"""On-policy distillation's term of the advantage, applied to a received batch before any backend sees it.

    A_t  <-  A_t + w * (teacher_logp_t - sampler_logp_t)        on loss tokens, w = `teacher_kl_weight`

`sampler_logp_t - teacher_logp_t` is the per-token sample of the reverse KL(student || teacher) along the
student's own trajectory; its negative as an advantage makes the policy gradient descend that KL (the
student's logprob is the sampler's: the same behaviour policy the importance ratio corrects for). The
orchestrator already scaled the environment's advantage by `orchestrator.teacher.env_weight` (0 = the
distillation term alone).

Invariants: a batch without a teacher (`teacher_kl_weight` == 0) is returned unchanged; rows are
replaced, never mutated in place (received arrays are read-only views of ZeroMQ frames); non-loss tokens
keep advantage 0; a non-finite teacher logprob on a loss token raises ValueError before training.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prime_async.transport.zmq_batches import RankBatch


def apply_teacher_advantage(batch: RankBatch) -> RankBatch:
    """`batch` with every row's advantages plus the distillation term (unchanged without a teacher)."""
    w = batch.teacher_kl_weight
    if w <= 0:
        return batch
    rows = []
    for mb in batch.micro_batches:
        teacher = mb.teacher_or_zeros()
        mask = np.asarray(mb.loss_mask, dtype=np.bool_)
        if not np.isfinite(teacher[mask]).all():
            raise ValueError(f"batch {batch.step}: teacher_logprobs is NaN/inf on a loss token")
        term = np.where(mask, teacher - mb.sampler_logprobs, 0.0).astype(np.float32)
        rows.append(dataclasses.replace(mb, advantages=(mb.advantages + w * term).astype(np.float32)))
    return dataclasses.replace(batch, micro_batches=rows)
