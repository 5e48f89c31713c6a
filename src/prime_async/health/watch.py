"""`HealthWatch`: one step's metrics in, the `health/*` metrics out, a WARNING when an alarm fires.

The trainer (rank 0) calls `observe(step, metrics)` with its own step metrics merged with the batch's
(the orchestrator ships `health_inputs` of its step metrics with each batch): every signal of every alarm
meets there. Invariants:
- `health/<alarm>` (0/1) is in every step's output for the six alarms; `health/<alarm>/value` once the
  alarm's windows are full (`window` steps of its metrics);
- one WARNING per onset (0 -> 1) of an alarm, naming the signal, its value, the threshold, the steps;
- with `stop_on_alarm`, `raise_if_stopping` raises `HealthStop` (a ValueError: one line, exit 2) after
  the step that fired was observed, so that step's metrics are logged first.
"""

from __future__ import annotations

import logging
from collections import deque

from prime_async.config.health import HealthConfig
from prime_async.health.alarms import (
    Reading,
    Window,
    advantage_drift,
    entropy_collapse,
    kl_acceleration,
    length_collapse,
    one_component,
    ratio_drift,
)

logger = logging.getLogger(__name__)

ALARMS = ("entropy_collapse", "kl_acceleration", "length_collapse", "one_component", "ratio_drift",
          "advantage_drift")  # fmt: skip
LENGTH = "rollout/trained_completion_tokens/mean"
SIGNALS = ("entropy", "mismatch_kl", "ratio/mean", "reward/mean", LENGTH, "batch/advantage/mean",
           "batch/advantage/abs_mean")  # fmt: skip
REWARD_FN = "/reward_fn/"


def watched(name: str) -> bool:
    """A metric some alarm reads: `SIGNALS`, `reward/<env>/mean`, `env/<env>/reward_fn/<fn>`."""
    return (
        name in SIGNALS
        or (name.startswith("reward/") and name.endswith("/mean") and name.count("/") == 2)
        or (name.startswith("env/") and REWARD_FN in name)
    )


def health_inputs(metrics: dict[str, float]) -> dict[str, float]:
    """The orchestrator's step metrics the trainer's watch reads, to ship with the batch: `reward/mean`,
    `reward/<env>/mean`, `env/<env>/reward_fn/<fn>` and the mean completion length."""
    return {name: value for name, value in metrics.items() if watched(name)}


class HealthStop(ValueError):
    """An alarm fired with `stop_on_alarm = true`: the trainer ends with this one line (exit 2)."""


def describe(reading: Reading) -> str:
    """The alarm in one line: signal, value, threshold, steps, and what the value is made of."""
    return (
        f"health alarm {reading.alarm}: {reading.signal} {reading.value:.4g} (alarm when {reading.op} "
        f"{reading.threshold:g}) over steps {reading.first}-{reading.last}: {reading.detail}"
    )


class HealthWatch:
    """The windows of the alarms' signals over the steps observed, and which alarms are on."""

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self._windows: dict[str, deque[tuple[int, float]]] = {}
        self._first_entropy: Window = []
        self._on: set[str] = set()
        self._stop: Reading | None = None

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Record the step's signals; return the `health/*` metrics; warn at each alarm's onset."""
        self._record(step, metrics)
        out = {f"health/{alarm}": 0.0 for alarm in ALARMS}
        for reading in self._readings():
            out[f"health/{reading.alarm}"] = float(reading.fired)
            out[f"health/{reading.alarm}/value"] = reading.value
            if reading.fired and reading.alarm not in self._on:
                logger.warning(describe(reading))
                self._stop = self._stop or reading
            if not reading.fired:
                self._on.discard(reading.alarm)
            else:
                self._on.add(reading.alarm)
        return out

    def raise_if_stopping(self, step: int) -> None:
        """With `stop_on_alarm`, end the trainer once an alarm fired (after its step was logged)."""
        if self.cfg.stop_on_alarm and self._stop is not None:
            raise HealthStop(
                f"stopped at step {step} by trainer.health.stop_on_alarm: {describe(self._stop)}"
            )

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            if watched(name):
                self._windows.setdefault(name, deque(maxlen=self.cfg.window)).append((step, float(value)))
        if "entropy" in metrics and len(self._first_entropy) < self.cfg.window:
            self._first_entropy.append((step, float(metrics["entropy"])))

    def _window(self, name: str) -> Window:
        return list(self._windows.get(name, ()))

    def _readings(self) -> list[Reading]:
        """Every alarm's reading whose windows are full; per env for one_component (the worst env)."""
        w = self._window
        readings = [
            entropy_collapse(self._first_entropy, w("entropy"), self.cfg),
            kl_acceleration(w("mismatch_kl"), self.cfg),
            length_collapse(w("reward/mean"), w(LENGTH), self.cfg),
            ratio_drift(w("ratio/mean"), self.cfg),
            advantage_drift(w("batch/advantage/mean"), w("batch/advantage/abs_mean"), self.cfg),
        ]
        per_env = [r for r in (self._one_component(env) for env in self._envs()) if r is not None]
        if per_env:
            readings.append(max(per_env, key=lambda r: (r.fired, r.value)))
        return [r for r in readings if r is not None]

    def _envs(self) -> list[str]:
        return sorted({name.split("/")[1] for name in self._windows if REWARD_FN in name})

    def _one_component(self, env: str) -> Reading | None:
        prefix = f"env/{env}{REWARD_FN}"
        parts = {n.removeprefix(prefix): self._window(n) for n in self._windows if n.startswith(prefix)}
        return one_component(env, self._window(f"reward/{env}/mean"), parts, self.cfg)
