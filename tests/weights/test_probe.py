"""The check after every weight load (`weights/probe.py`, `weights/probe_check.py`): the comparison's
figures, the window metrics, the ERROR line and `on_mismatch = "stop"`, on fake engine answers."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from prime_async.config.probe import WeightProbeConfig
from prime_async.weights.probe import ProbeDist, ProbeReference, compare, dist_divergence, max_abs_diff
from prime_async.weights.probe_check import ProbeMismatch, WeightProbe, tops_at

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def _ref() -> ProbeReference:
    dist = ProbeDist(0, 2, [5, 6], [LOG_HALF, LOG_QUARTER])  # rest bucket: 0.25
    return ProbeReference([[1, 5, 6]], [[-1.0, -2.0]], [dist], top_k=2)


def test_identical_answers_have_zero_figures():
    ref = _ref()
    f = compare(ref, [[-1.0, -2.0]], [{5: LOG_HALF, 6: LOG_QUARTER}])
    assert (
        f.max_abs_logprob_diff == 0.0 and f.kl == pytest.approx(0.0, abs=1e-12) and f.tv == pytest.approx(0)
    )


def test_sampled_token_diff_is_the_largest_abs_difference():
    assert max_abs_diff([[-1.0, -2.0], [-3.0]], [[-1.1, -2.0], [-2.5]]) == pytest.approx(0.5)
    assert max_abs_diff([[-1.0]], [[-1.0, -2.0]]) == math.inf  # another shape: a mismatch
    assert max_abs_diff([[-1.0]], [[float("nan")]]) == math.inf


def test_divergence_counts_the_rest_bucket_and_a_missing_token_at_the_engine_floor():
    trainer = ProbeDist(0, 1, [5, 6], [LOG_HALF, LOG_QUARTER])
    kl, tv = dist_divergence(trainer, {5: LOG_QUARTER, 6: LOG_HALF})  # rest 0.25 on both sides
    assert tv == pytest.approx(0.25)
    assert kl == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5))
    kl, tv = dist_divergence(trainer, {5: math.log(0.9), 7: math.log(0.05)})  # 6 missing: gets 0.05
    assert tv == pytest.approx(0.5 * (0.4 + 0.2 + 0.2))
    assert dist_divergence(trainer, {}) == (math.inf, 1.0)


def test_engine_tops_are_taken_at_the_reference_positions():
    ref = _ref()  # dist at sequence 0, position 2 -> the engine's second scored position (start 1)
    assert tops_at(ref, [[{1: -0.1}, {5: -0.7}]]) == [{5: -0.7}]
    assert tops_at(ref, [[{1: -0.1}]]) == [{}]  # missing: compare() sees a total mismatch


class FakeEngine:
    def __init__(self, lps: list[float], top: dict[int, float]):
        self.lps, self.top = lps, top

    async def score_top(self, sequences, starts, top_n, *, temperature=1.0):
        assert starts == [1] and top_n == 2
        return [(self.lps, [{}, self.top])]


def test_probe_window_metrics_and_error_line(caplog):
    good = FakeEngine([-1.0, -2.0], {5: LOG_HALF, 6: LOG_QUARTER})
    bad = FakeEngine([-1.0, -4.0], {5: LOG_QUARTER, 6: LOG_HALF})
    probe = WeightProbe(WeightProbeConfig(), [good, bad])
    probe.remember(3, _ref())
    with caplog.at_level(logging.ERROR):
        f = asyncio.run(probe.check(3))
    assert f is not None and f.max_abs_logprob_diff == pytest.approx(2.0) and f.tv == pytest.approx(0.25)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("weights v3: ") and "KL" in errors[0]
    m = probe.metrics()
    assert m["weights/probe_max_abs_logprob_diff"] == pytest.approx(2.0) and "weights/probe_time_s" in m
    assert probe.metrics() == {}  # reset per window
    assert asyncio.run(probe.check(4)) is None  # no reference: not checked


def test_probe_within_thresholds_is_quiet_and_stop_raises(caplog):
    ok = WeightProbe(WeightProbeConfig(), [FakeEngine([-1.01, -2.0], {5: LOG_HALF, 6: LOG_QUARTER})])
    ok.remember(1, _ref())
    with caplog.at_level(logging.ERROR):
        asyncio.run(ok.check(1))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    stop = WeightProbe(WeightProbeConfig(on_mismatch="stop"), [FakeEngine([-1.0, -9.0], {5: 0.0})])
    stop.remember(2, _ref())
    with pytest.raises(ProbeMismatch, match="weights v2"):
        asyncio.run(stop.check(2))


def test_probe_that_cannot_be_scored_only_warns(caplog):
    class Broken:
        async def score_top(self, *a, **k):
            raise RuntimeError("HTTP 400")

    probe = WeightProbe(WeightProbeConfig(on_mismatch="stop"), [Broken()])
    probe.remember(1, _ref())
    assert asyncio.run(probe.check(1)) is None and probe.metrics() == {}
