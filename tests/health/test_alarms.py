"""Training-health alarms on synthetic metric streams: each fires on its pattern at the step its window
first crosses the threshold (worked out below with the default window of 10), warns once naming the
signal, value, threshold and steps, and stays quiet on a healthy stream and on a real tiny run's curves
(`tiny_run_metrics.jsonl`, recorded from `rl @ configs/tiny/rl.toml --max-steps 40`)."""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from prime_async.config.health import HealthConfig
from prime_async.health.watch import ALARMS, HealthStop, HealthWatch, health_inputs

FIXTURE = Path(__file__).with_name("tiny_run_metrics.jsonl")
Pattern = Callable[[int], dict[str, float]]


def healthy(step: int, rng: random.Random | None = None) -> dict[str, float]:
    """A run with nothing wrong: flat curves with a little noise, two reward functions rising together."""
    rng = rng or random.Random(step)
    noise = lambda scale: rng.uniform(-scale, scale)  # noqa: E731
    format_, correct = 0.5 + 0.01 * step + noise(0.05), 0.2 + 0.01 * step + noise(0.05)
    return {
        "entropy": 1.0 + noise(0.1),
        "mismatch_kl": 1e-3 * (1 + noise(0.3)),
        "ratio/mean": 1.0 + noise(0.02),
        "reward/mean": (format_ + correct) / 2,
        "rollout/trained_completion_tokens/mean": 100 + noise(10),
        "batch/advantage/mean": noise(0.05),
        "batch/advantage/abs_mean": 0.5,
        "reward/math/mean": (format_ + correct) / 2,
        "env/math/reward_fn/format": format_,
        "env/math/reward_fn/correct": correct,
    }


def after(onset: int, change: Callable[[int, dict[str, float]], None]) -> Pattern:
    """The healthy stream, changed by `change(k, metrics)` from step `onset` on (k = steps since onset)."""

    def pattern(step: int) -> dict[str, float]:
        metrics = healthy(step)
        if step >= onset:
            change(step - onset, metrics)
        return metrics

    return pattern


def entropy_collapse(k: int, m: dict[str, float]) -> None:
    m["entropy"] = 0.01  # last window all 0.01 at step 19: 0.01 / ~1.0 < 0.1; at 18: ~0.11


def kl_acceleration(k: int, m: dict[str, float]) -> None:
    m["mismatch_kl"] = 1e-2 * 2.0 ** (k + 1)  # doubling from 2e-2: past kl_floor, 4x the first third


def length_collapse(k: int, m: dict[str, float]) -> None:
    m["reward/mean"] += 0.05 * (k + 1)  # halves 5-9 / 10-14 at step 14: reward +0.19, length 0.39x
    m["rollout/trained_completion_tokens/mean"] = 100 * 0.7 ** (k + 1)


def one_component(k: int, m: dict[str, float]) -> None:
    # format up to 1, correct flat at 0.2: the reward's rise reaches 0.1 at step 15 (halves 6-10 / 11-15)
    m["env/math/reward_fn/format"] = min(1.0, 0.6 + 0.1 * k)
    m["env/math/reward_fn/correct"] = 0.2
    m["reward/math/mean"] = m["reward/mean"] = (m["env/math/reward_fn/format"] + 0.2) / 2


def ratio_drift(k: int, m: dict[str, float]) -> None:
    m["ratio/mean"] = 1.3  # window mean - 1 = 0.03 * new steps: > 0.1 with 4 of them (step 13)


def advantage_drift(k: int, m: dict[str, float]) -> None:
    m["batch/advantage/mean"] = 0.4  # |mean| / 0.5: 0.08 * new steps > 0.5 with 7 of them (step 16)


PATTERNS: dict[str, tuple[Pattern, int]] = {  # alarm: (stream, the step it fires first)
    "entropy_collapse": (after(10, entropy_collapse), 19),
    "kl_acceleration": (after(10, kl_acceleration), 11),
    "length_collapse": (after(10, length_collapse), 14),
    "one_component": (after(10, one_component), 15),
    "ratio_drift": (after(10, ratio_drift), 13),
    "advantage_drift": (after(10, advantage_drift), 16),
}


def run(stream: Pattern | list[dict[str, float]], steps: int, cfg: HealthConfig | None = None):
    """Feed the stream; return (alarm -> steps it was on, each step's health metrics)."""
    watch = HealthWatch(cfg or HealthConfig())
    on: dict[str, list[int]] = {}
    rows = []
    for step in range(steps):
        metrics = stream(step) if callable(stream) else stream[step]
        out = watch.observe(step, metrics)
        rows.append(out)
        for alarm in ALARMS:
            if out[f"health/{alarm}"]:
                on.setdefault(alarm, []).append(step)
    return on, rows


@pytest.mark.parametrize("alarm", ALARMS)
def test_each_alarm_fires_on_its_pattern_at_its_step_and_warns_once(alarm, caplog):
    stream, expected = PATTERNS[alarm]
    with caplog.at_level(logging.WARNING, logger="prime_async.health.watch"):
        on, rows = run(stream, 30)
    assert set(on) == {alarm}, f"{alarm}'s pattern set off {sorted(on)}"
    assert on[alarm][0] == expected
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # once at the onset, not every step it stays on
    assert warnings[0].startswith(f"health alarm {alarm}: ")
    assert f"over steps {expected - 9}-{expected}" in warnings[0] or alarm == "entropy_collapse"
    assert "alarm when" in warnings[0]
    value = re.match(r"health alarm \w+: \S+ (\S+) \(alarm when", warnings[0])
    assert value is not None
    assert rows[expected][f"health/{alarm}/value"] == pytest.approx(float(value[1]), rel=1e-3)


def test_a_healthy_stream_sets_off_nothing():
    for seed in range(5):
        rng = random.Random(seed)
        on, rows = run(lambda step, rng=rng: healthy(step, rng), 60)
        assert on == {}
    assert set(rows[0]) == {f"health/{alarm}" for alarm in ALARMS}  # flags from step 0, values once full
    assert {f"health/{alarm}/value" for alarm in ALARMS} <= set(rows[-1])


def test_the_real_tiny_run_sets_off_nothing():
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(rows) >= 30
    on, health = run(rows, len(rows))
    assert on == {}, f"alarms on the real tiny run: {on}"
    values = {a: max(h[f"health/{a}/value"] for h in health if f"health/{a}/value" in h) for a in ALARMS[:3]}
    assert all(math.isfinite(v) for v in values.values())


def test_two_rising_components_are_not_one_component():
    def both(k: int, m: dict[str, float]) -> None:
        m["env/math/reward_fn/format"] = m["env/math/reward_fn/correct"] = 0.2 + 0.05 * k
        m["reward/math/mean"] = m["reward/mean"] = 0.2 + 0.05 * k

    assert run(after(10, both), 30)[0] == {}


def test_stop_on_alarm_raises_one_line_after_the_step_was_observed():
    watch = HealthWatch(HealthConfig(stop_on_alarm=True))
    stream = PATTERNS["ratio_drift"][0]
    for step in range(13):
        watch.observe(step, stream(step))
        watch.raise_if_stopping(step)
    out = watch.observe(13, stream(13))
    assert out["health/ratio_drift"] == 1.0
    with pytest.raises(HealthStop, match=r"stopped at step 13 by trainer.health.stop_on_alarm: health alarm "
                       r"ratio_drift: ratio/mean 0.1137 \(alarm when > 0.1\) over steps 4-13"):  # fmt: skip
        watch.raise_if_stopping(13)
    assert isinstance(HealthStop("x"), ValueError)  # the entrypoints' policy: one line, exit 2


def test_without_stop_on_alarm_nothing_raises():
    watch = HealthWatch(HealthConfig())
    stream = PATTERNS["ratio_drift"][0]
    for step in range(20):
        watch.observe(step, stream(step))
        watch.raise_if_stopping(step)


def test_health_inputs_keep_what_the_alarms_read_of_the_orchestrators_metrics():
    metrics = {
        "reward/mean": 0.5, "reward/std": 0.1, "reward/math/mean": 0.5, "reward/seat/a/mean": 1.0,
        "env/math/reward_fn/format": 1.0, "env/math/metric/exact": 0.0, "ledger/trained": 8.0,
        "rollout/trained_completion_tokens/mean": 12.0, "rollout/trained_completion_tokens": 48.0,
    }  # fmt: skip
    assert health_inputs(metrics) == {
        "reward/mean": 0.5, "reward/math/mean": 0.5, "env/math/reward_fn/format": 1.0,
        "rollout/trained_completion_tokens/mean": 12.0,
    }  # fmt: skip
