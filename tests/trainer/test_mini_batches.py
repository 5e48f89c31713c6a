"""`optim.num_steps_per_batch`: the mini-batch split, the effective off-policy distance, and the FSDP
backend with several optimizer steps per batch on the tiny model (one process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prime_async.config.shared import ModelConfig
from prime_async.config.trainer import OptimConfig, TrainerConfig
from prime_async.testing.synthetic import make_batch
from prime_async.trainer.fsdp import FsdpBackend
from prime_async.trainer.mini_batches import OffPolicyClock, plan_mini_batches, split_mini_batches
from prime_async.transport.types import MicroBatch
from prime_async.transport.zmq_batches import RankBatch


@pytest.mark.parametrize(
    ("n", "steps", "sizes"),
    [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (1, 3, [1, 0, 0]), (3, 1, [3])],
)
def test_split_is_contiguous_and_balanced(n: int, steps: int, sizes: list[int]) -> None:
    chunks = split_mini_batches(list(range(n)), steps)
    assert [len(c) for c in chunks] == sizes
    assert [x for c in chunks for x in c] == list(range(n))


def _rows(lens: list[list[int]], step: int = 0) -> list[MicroBatch]:
    return make_batch(step, [lens], seed=3).micro_batches[0]


def test_plan_counts_loss_tokens_per_mini_batch() -> None:
    rows = _rows([[8, 6], [5], [9]])
    total = sum(mb.num_loss_tokens for mb in rows)
    plan = plan_mini_batches(rows, 2, num_loss_tokens=total, step=4)
    assert [(len(c), n) for c, n in plan] == [
        (2, rows[0].num_loss_tokens + rows[1].num_loss_tokens),
        (1, rows[2].num_loss_tokens),
    ]
    assert plan_mini_batches(rows, 1, num_loss_tokens=total, step=4) == [(rows, total)]
    with pytest.raises(ValueError, match=f"batch 4: its micro-batches hold {total} loss tokens"):
        plan_mini_batches(rows, 2, num_loss_tokens=total + 1, step=4)


def test_effective_distance_counts_versions_and_steps_taken() -> None:
    mb = _rows([[6]])[0]
    mb.token_versions = np.array([-1, -1, -1, 3, 2, -1], dtype=np.int32)  # the last: no version reported
    clock = OffPolicyClock(step=4, steps_per_batch=2, fallback_version=1)
    # (4 - v) * 2 + steps taken; unknown versions take the batch's oldest dispatch version (1)
    assert clock.distance(mb, steps_taken=1)[3:].tolist() == [3, 5, 7]
    assert OffPolicyClock(4, 1, 1).distance(mb, steps_taken=0)[3:].tolist() == [1, 2, 3]


def _cfg(model_dir: Path, num_steps: int) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        optim=OptimConfig(lr=1e-3, num_steps_per_batch=num_steps),
    )


def _rank_batch(mbs: list[MicroBatch], step: int, min_dispatch_version: int) -> RankBatch:
    return RankBatch(
        step=step,
        rank=0,
        micro_batches=mbs,
        layout=[[mb.num_tokens for mb in mbs]],
        num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs),
        temperature=1.0,
        min_dispatch_version=min_dispatch_version,
    )


def _backend(model_dir: Path, num_steps: int) -> FsdpBackend:
    """The FSDP backend on one process (no process group): the tiny model as saved, unsharded."""
    torch.set_num_threads(1)
    return FsdpBackend(_cfg(model_dir, num_steps), torch.device("cpu"), world_size=1)


def _versioned_rows(step: int) -> list[MicroBatch]:
    mbs = _rows([[20, 12], [16], [10, 9], [14]], step)
    for i, mb in enumerate(mbs):  # tokens of rows 0, 1 at version step - 1; rows 2, 3 at step - 2
        mb.token_versions = np.where(mb.loss_mask, step - 1 - i // 2, -1).astype(np.int32)
    return mbs


def test_two_steps_per_batch_equal_two_batches_of_half(tiny_model_dir: Path) -> None:
    """S = 2 on rows [r0, r1, r2, r3] trains exactly as two S = 1 steps on [r0, r1] then [r2, r3], each
    normalized by its own loss tokens (constant LR: the schedule counts batches, not optimizer steps)."""
    mbs = _versioned_rows(step=3)
    two = _backend(tiny_model_dir, 2)
    metrics = two.train_rank_batch(_rank_batch(mbs, step=3, min_dispatch_version=1))
    ref = _backend(tiny_model_dir, 1)
    halves = [ref.train_rank_batch(_rank_batch(part, 3, 1)) for part in (mbs[:2], mbs[2:])]
    for name, p in two.model.named_parameters():
        torch.testing.assert_close(p, dict(ref.model.named_parameters())[name], rtol=1e-5, atol=1e-6)
    assert metrics["optim/num_steps"] == 2 and two.scheduler.last_epoch == 1
    n0, n1 = sum(mb.num_loss_tokens for mb in mbs[:2]), sum(mb.num_loss_tokens for mb in mbs[2:])
    token_mean = (halves[0]["loss/total"] * n0 + halves[1]["loss/total"] * n1) / (n0 + n1)
    assert metrics["loss/total"] == pytest.approx(token_mean, rel=1e-5)
    assert metrics["optim/grad_norm"] == pytest.approx(
        (halves[0]["optim/grad_norm"] + halves[1]["optim/grad_norm"]) / 2, rel=1e-4
    )
    # rows 0-1: version 2, first mini-batch: (3 - 2) * 2 + 0 = 2; rows 2-3: version 1, second: 4 * 1 + 1 = 5
    assert metrics["offpolicy/effective_steps/mean"] == pytest.approx((2 * n0 + 5 * n1) / (n0 + n1))
    assert metrics["offpolicy/effective_steps/max"] == 5


def test_more_steps_than_micro_batches_skips_the_empty_ones(tiny_model_dir: Path) -> None:
    mbs = _versioned_rows(step=2)[:2]
    metrics = _backend(tiny_model_dir, 3).train_rank_batch(_rank_batch(mbs, step=2, min_dispatch_version=1))
    assert metrics["optim/num_steps"] == 2  # chunks [r0], [r1], [] -> two optimizer steps
    assert metrics["offpolicy/effective_steps/max"] == 1 * 3 + 1  # row 1 (version 1), after one step
    assert all(np.isfinite(v) for v in metrics.values())


def test_on_policy_kl_and_unknown_versions_at_k0(tiny_model_dir: Path) -> None:
    """K = 0, S = 2: every row sampled by the batch's version; row 1's loss tokens carry no version.
    Only row 0 is trained by the weights that sampled it (first mini-batch, version known), so
    `mismatch_kl/on_policy` is exactly row 0's KL before any update; row 1 is counted as unknown."""
    step = 3
    mbs = _rows([[20, 12], [16], [10, 9], [14]], step)
    for i, mb in enumerate(mbs):
        mb.token_versions = np.where(mb.loss_mask, -1 if i == 1 else step, -1).astype(np.int32)
    metrics = _backend(tiny_model_dir, 2).train_rank_batch(_rank_batch(mbs, step, min_dispatch_version=step))
    row0 = _backend(tiny_model_dir, 1).train_rank_batch(_rank_batch(mbs[:1], step, step))
    assert metrics["offpolicy/effective_steps/max"] == 1  # the second mini-batch, by design
    assert metrics["offpolicy/on_policy_tokens"] == mbs[0].num_loss_tokens
    assert metrics["offpolicy/unknown_version_tokens"] == mbs[1].num_loss_tokens
    assert metrics["mismatch_kl/on_policy"] == pytest.approx(row0["mismatch_kl"], rel=1e-6)
    assert metrics["mismatch_kl/on_policy"] != pytest.approx(metrics["mismatch_kl"], rel=1e-3)
