"""Validation of a plan against real runs: the config as given, and the candidate the plan recommends.

    profile run ──► predictions for every candidate ──► recommended (report.recommend)
    measured run of the config as given            ──► predicted vs measured: step time, staleness
    measured run of the recommended candidate       ──► (its flags appended to the same rl arguments)

`scripts/validate_plan.py` runs it on real configs; the recommendation is the prediction the user acts
on, so it is measured too whenever it differs from the config as given.

Invariants: measured figures are read after the same warm-up the profile and the simulation leave out
(`WARMUP_STEPS`); a staleness share is the fraction of trained groups with `step - dispatch_version = k`,
over the steady-state steps, from the orchestrator's `rollout/data_staleness/ratio_<k>` weighted by the
step's `rollout/trained_groups` (the simulation counts the same groups the same way).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prime_async.launcher.child_run import without_flags
from prime_async.plan.candidates import Candidate, Prediction
from prime_async.plan.profile import WARMUP_STEPS
from prime_async.plan.report import recommend
from prime_async.utils.monitor import read_jsonl

RATIO_PREFIX = "rollout/data_staleness/ratio_"
KNOB_FLAGS = tuple(  # the knobs a candidate sets, as the user may have spelled them
    f"--orchestrator.{spelled}"
    for name in ("max_off_policy_steps", "admission.max_inflight_groups", "admission.max_buffered_groups")
    for spelled in (name, name.replace("_", "-"))
)


@dataclass(frozen=True)
class Measured:
    """A real run's steady state: mean `time/step` and the staleness shares of its trained groups."""

    run_dir: Path
    steps: int  # steady-state steps read
    step_time_s: float
    staleness: dict[int, float]


def measure(run_dir: Path, *, warmup: int = WARMUP_STEPS) -> Measured:
    """The steady state of the run in `run_dir`; ValueError naming the file when it has none."""
    path = run_dir / "metrics" / "orchestrator.jsonl"
    rows = [m for m in read_jsonl(path) if m["step"] >= warmup]
    if not rows:
        raise ValueError(f"{path}: no step after the first {warmup}: nothing to measure")
    ages: Counter[int] = Counter()
    for m in rows:
        groups = m.get("rollout/trained_groups", 1.0)
        for key, share in m.items():
            if key.startswith(RATIO_PREFIX):
                ages[int(key.removeprefix(RATIO_PREFIX))] += share * groups
    total = sum(ages.values()) or 1.0
    return Measured(
        run_dir=run_dir,
        steps=len(rows),
        step_time_s=statistics.fmean(m["time/step"] for m in rows),
        staleness={age: n / total for age, n in sorted(ages.items()) if n > 0},
    )


def mean_staleness(shares: dict[int, float]) -> float:
    return sum(age * share for age, share in shares.items())


def to_validate(predictions: list[Prediction]) -> list[tuple[str, Prediction]]:
    """("as given", its prediction), then ("recommended", ...) when the plan recommends another setting."""
    now = next(p for p in predictions if p.candidate.current)
    best = recommend(predictions, now.candidate.engines)
    out = [("as given", now)]
    if best.candidate != now.candidate:
        out.append(("recommended", best))
    return out


def candidate_argv(rl_argv: list[str], cand: Candidate) -> list[str]:
    """The user's `rl` arguments with the candidate's knobs (any the user set replaced)."""
    return [*without_flags(rl_argv, KNOB_FLAGS), *cand.flags().split()]


@dataclass(frozen=True)
class Comparison:
    label: str  # "as given" or "recommended"
    prediction: Prediction
    measured: Measured

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return (self.prediction.step_time_s - self.measured.step_time_s) / self.measured.step_time_s

    @property
    def staleness_error(self) -> float:
        """Predicted minus measured mean staleness (steps)."""
        return mean_staleness(self.prediction.staleness) - mean_staleness(self.measured.staleness)

    def row(self, name: str) -> str:
        c, p, m = self.prediction.candidate, self.prediction, self.measured
        return (
            f"| {name} | {self.label}: K = {c.k}, in flight {c.max_inflight_groups}, buffer "
            f"{c.max_buffered_groups} | {p.step_time_s:.3f} | {m.step_time_s:.3f} ({m.steps} steps) | "
            f"{self.step_error:+.1%} | {_shares(p.staleness)} | {_shares(m.staleness)} |"
        )


HEADER = (
    "| config | candidate | predicted step (s) | measured step (s) | error | predicted staleness | "
    "measured staleness |\n|---|---|---|---|---|---|---|"
)


def _shares(shares: dict[int, float]) -> str:
    return " ".join(f"{age}:{share:.0%}" for age, share in sorted(shares.items())) or "-"
