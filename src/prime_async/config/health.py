"""`[trainer.health]`: the thresholds of the training-health alarms (`prime_async/health/`).

The alarms watch the per-step metrics the trainer sees (its own and those the orchestrator ships with each
batch) over trailing windows of `window` steps. Invariants: every threshold is a plain number compared to
one logged value (`health/<alarm>/value`); the defaults stay quiet on the project's tiny and demo runs
(tests/health/).
"""

from __future__ import annotations

from pydantic import Field

from prime_async.config.base import BaseConfig


class HealthConfig(BaseConfig):
    """Training-health alarms: each is `health/<alarm>` (0/1) + `health/<alarm>/value` and a WARNING."""

    enabled: bool = Field(True, description="Watch the metrics and log the `health/*` alarms (rank 0).")
    window: int = Field(
        10, ge=3, description="Steps of the trailing windows the alarms compare (halves, thirds of it)."
    )
    stop_on_alarm: bool = Field(
        False,
        description="An alarm ends the trainer with a one-line error (exit 2); `rl` then fails the run "
        "(with restart.max_restarts = 0, the default).",
    )
    entropy_drop: float = Field(
        0.1, gt=0, description="entropy_collapse: last window's mean entropy below this share of the first's."
    )
    kl_growth: float = Field(
        4.0,
        gt=1,
        description="kl_acceleration: the window's last third mean mismatch_kl at least this multiple of "
        "its first third's, each third rising faster than the one before.",
    )
    kl_floor: float = Field(
        1e-2, ge=0,
        description="kl_acceleration: ignored while mismatch_kl stays below (a healthy tiny run: ~2e-3).",
    )  # fmt: skip
    reward_rise: float = Field(
        0.1,
        gt=0,
        description="length_collapse and one_component: the reward's rise (second half of the window "
        "minus first) that makes them look.",
    )
    length_drop: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="length_collapse: mean completion tokens of the second half at most this share of the "
        "first's while the reward rose.",
    )
    component_share: float = Field(
        0.9,
        gt=0,
        le=1,
        description="one_component: one reward function's share of the rises of an env's reward functions "
        "(its rubric's env/<name>/reward_fn/*) while the env's reward rose.",
    )
    ratio_drift: float = Field(
        0.1, gt=0, description="ratio_drift: |window mean of ratio/mean - 1| above this."
    )
    advantage_drift: float = Field(
        0.5,
        gt=0,
        description="advantage_drift: |window mean of the token-mean advantage| above this share of the "
        "window mean of its absolute value (batch/advantage/{mean,abs_mean}).",
    )
