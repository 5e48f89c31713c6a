"""What the orchestrator gives the trainer's health alarms: `batch/advantage/{mean,abs_mean}` over the
batch's loss tokens, `rollout/trained_completion_tokens/mean` per trajectory, and `health_inputs` of its
step metrics (shipped with the batch)."""

from __future__ import annotations

import pytest

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.health.watch import health_inputs
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.metrics import batch_metrics
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode, PolicySpan


def episode(completion: int, reward: float) -> Episode:
    n = 3 + completion
    return Episode(
        example_id=0, token_ids=list(range(1, n + 1)), loss_mask=[False] * 3 + [True] * completion,
        sampler_logprobs=[0.0] * 3 + [-0.5] * completion, token_versions=[-1] * 3 + [0] * completion,
        reward=reward, span=PolicySpan(0, 0),
    )  # fmt: skip


def test_token_advantages_and_mean_completion_length():
    # one group: rewards 1 and 0 -> advantages +0.5 (2 tokens) and -0.5 (6 tokens)
    group = Group(group_id=0, example_id=0, dispatch_version=0, episodes=[episode(2, 1.0), episode(6, 0.0)])
    batch = build_train_batch(
        [group], step=0, seq_len=64, num_ranks=1, temperature=1.0, advantage_cfg=AdvantageConfig()
    )
    assert batch.metrics["batch/advantage/mean"] == pytest.approx((2 * 0.5 - 6 * 0.5) / 8)
    assert batch.metrics["batch/advantage/abs_mean"] == pytest.approx(0.5)
    metrics = batch_metrics([group], step=0)
    assert metrics["rollout/trained_completion_tokens/mean"] == 4.0
    assert set(health_inputs(metrics)) == {
        "reward/mean", "reward/default/mean", "rollout/trained_completion_tokens/mean"
    }  # fmt: skip
