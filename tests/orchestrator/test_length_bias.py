"""Length bias (`orchestrator/length_bias.py`): trained vs finished completion lengths per env, and the
warning when staleness control made training shorter than generation."""

from __future__ import annotations

import logging

import pytest

from prime_async.orchestrator.length_bias import LengthBias
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


def _group(env: str, lengths: list[int]) -> Group:
    group = Group(group_id=0, example_id=0, dispatch_version=0, env=env)
    group.episodes = [Episode(example_id=0, loss_mask=[True] * n) for n in lengths]
    return group


def test_bias_is_trained_over_finished_mean_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    bias = LengthBias()
    short, long = [_group("a", [10, 10]) for _ in range(5)], [_group("a", [30, 30]) for _ in range(5)]
    for g in short + long:
        bias.finished(g)
    bias.trained(short)  # the long groups were dropped as stale
    bias.finished(_group("b", [5]))
    bias.trained([_group("b", [5])])
    m = bias.metrics()
    assert m["rollout/length/finished/mean"] == pytest.approx(405 / 21)
    assert m["rollout/env/a/length_bias"] == pytest.approx(10 / 20)
    assert m["rollout/env/b/length_bias"] == 1.0
    assert m["rollout/length/trained/p90"] == 10.0
    with caplog.at_level(logging.WARNING):
        bias.warn_if_biased(stale_or_cancelled=0)  # nothing was dropped: not staleness's doing
        assert not caplog.records
        bias.warn_if_biased(stale_or_cancelled=10)
        bias.warn_if_biased(stale_or_cancelled=10)
    (record,) = caplog.records
    assert "env a: trained episodes are 50% shorter" in record.getMessage()


def test_cancelled_episodes_count_as_generated_with_what_they_sampled() -> None:
    """K = 0 with a buffer of two batches: the slow (long) groups are cancelled at every cut. Counting
    only finished episodes would show no bias at all."""
    bias = LengthBias()
    fast = [_group("a", [10, 10]) for _ in range(4)]
    for g in fast:
        bias.finished(g)
    bias.trained(fast)
    assert bias.bias("a") == 1.0
    bias.cancelled("a", [25, 35, 30, 30])  # the long episodes, cut while running
    m = bias.metrics()
    assert m["rollout/length/cancelled/mean"] == 30.0
    assert m["rollout/env/a/length_bias"] == pytest.approx(10 / ((80 + 120) / 12))
    assert m["rollout/length/finished/mean"] == 10.0  # the finished population is unchanged
