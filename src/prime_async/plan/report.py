"""The planner's table and recommendation.

The recommendation is taken among the candidates with the engines the run already has (engines are
hardware): the fastest predicted step, except that a smaller K within `TOLERANCE` of it wins (less
staleness for the same speed), then the smaller buffer. The engines-to-trainer line compares the best
candidate at n engines with the best at 2n.
"""

from __future__ import annotations

from prime_async.plan.candidates import Prediction

TOLERANCE = 0.05


def recommend(predictions: list[Prediction], engines: int) -> Prediction:
    pool = [p for p in predictions if p.candidate.engines == engines]
    fastest = min(p.step_time_s for p in pool)
    close = [p for p in pool if p.step_time_s <= fastest * (1 + TOLERANCE)]
    return min(
        close,
        key=lambda p: (p.candidate.k, p.candidate.max_buffered_groups, p.candidate.max_inflight_groups),
    )


def render(predictions: list[Prediction], measured_step_s: float) -> str:
    """One line per candidate, sorted by engines then predicted step time; `*` marks the current config."""
    lines = [
        f"{'':2}{'K':>2} {'inflight':>8} {'buffered':>8} {'engines':>7} {'step (s)':>9} {'vs now':>7}  "
        "staleness of trained groups (steps: share)"
    ]
    now = next(p for p in predictions if p.candidate.current)
    for p in sorted(predictions, key=lambda p: (p.candidate.engines, p.step_time_s)):
        c = p.candidate
        mark = "* " if c.current else "  "
        ratio = now.step_time_s / p.step_time_s if p.step_time_s else float("nan")
        lines.append(
            f"{mark}{c.k:>2} {c.max_inflight_groups:>8} {c.max_buffered_groups:>8} {c.engines:>7} "
            f"{p.step_time_s:>9.3f} {ratio:>6.2f}x  {p.staleness_text()}"
        )
    lines.append(
        f"* = the config as given: predicted {now.step_time_s:.3f} s/step, measured {measured_step_s:.3f} "
        f"s/step in the profile ({_error(now.step_time_s, measured_step_s)})"
    )
    return "\n".join(lines)


def recommendation(predictions: list[Prediction]) -> str:
    now = next(p for p in predictions if p.candidate.current)
    engines = now.candidate.engines
    best = recommend(predictions, engines)
    more = (
        recommend(predictions, 2 * engines)
        if any(p.candidate.engines == 2 * engines for p in predictions)
        else None
    )
    lines = [
        f"recommended: K = {best.candidate.k}, max_inflight_groups = {best.candidate.max_inflight_groups}, "
        f"max_buffered_groups = {best.candidate.max_buffered_groups}: {best.step_time_s:.3f} s/step "
        f"predicted ({now.step_time_s / best.step_time_s:.2f}x the config as given), staleness "
        f"{best.staleness_text()}",
        f"  flags: {best.candidate.flags()}",
    ]
    if more is not None:
        lines.append(
            f"engines-to-trainer: {2 * engines} engines per trainer instead of {engines} would give "
            f"{more.step_time_s:.3f} s/step ({best.step_time_s / more.step_time_s:.2f}x) at K = "
            f"{more.candidate.k} (on separate accelerators; engines on the same CPU cores share them)"
        )
    return "\n".join(lines)


def _error(predicted: float, measured: float) -> str:
    if measured <= 0:
        return "no measurement"
    return f"{(predicted - measured) / measured:+.1%}"
