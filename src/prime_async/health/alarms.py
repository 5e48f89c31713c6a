"""The training-health alarms, each a pure function of metric windows and `HealthConfig`.

A window is a list of `(step, value)` pairs, oldest first, one per step that logged the metric. Each
function returns a `Reading` (the alarm's value, its threshold, whether it fired, the steps it spans), or
None while its windows are not full: an alarm never fires on fewer than `window` steps.

    entropy_collapse  last window's mean `entropy` / first window's             < entropy_drop
    kl_acceleration   last third / first third of `mismatch_kl`, rising faster  >= kl_growth
    length_collapse   completion length 2nd half / 1st half, reward up          <= length_drop
    one_component     one reward function's share of the reward's rise          >= component_share
    ratio_drift       |mean ratio/mean - 1|                                     > ratio_drift
    advantage_drift   |mean token advantage| / mean |token advantage|           > advantage_drift
"""

from __future__ import annotations

from dataclasses import dataclass

from prime_async.config.health import HealthConfig

Window = list[tuple[int, float]]


@dataclass(frozen=True)
class Reading:
    """One alarm's verdict at one step: `value` compared by `op` to `threshold` over steps first..last."""

    alarm: str
    signal: str
    value: float
    op: str
    threshold: float
    fired: bool
    first: int
    last: int
    detail: str = ""


def _mean(window: Window) -> float:
    return sum(v for _, v in window) / len(window)


def _halves(window: Window) -> tuple[float, float]:
    half = len(window) // 2
    return _mean(window[:half]), _mean(window[-half:])


def entropy_collapse(first: Window, recent: Window, cfg: HealthConfig) -> Reading | None:
    """The last window's mean entropy as a share of the first window's (the lifetime's first steps)."""
    if len(first) < cfg.window or len(recent) < cfg.window:
        return None
    base, now = _mean(first), _mean(recent)
    value = now / base if base > 0 else 1.0
    return Reading(
        "entropy_collapse", "entropy", value, "<", cfg.entropy_drop, value < cfg.entropy_drop,
        first[0][0], recent[-1][0], f"entropy {now:.4g} vs {base:.4g} at first",
    )  # fmt: skip


def kl_acceleration(kl: Window, cfg: HealthConfig) -> Reading | None:
    """mismatch_kl growing ever faster: the window's thirds m1, m2, m3 with m3 - m2 > max(m2 - m1, 0)
    and m3 >= kl_floor; the value is m3 / m1 (0 when the last third does not rise faster)."""
    if len(kl) < cfg.window:
        return None
    third = len(kl) // 3
    m1, m2, m3 = _mean(kl[:third]), _mean(kl[third : 2 * third]), _mean(kl[-third:])
    accelerating = m3 - m2 > max(m2 - m1, 0.0) and m3 >= cfg.kl_floor
    value = m3 / max(m1, 1e-12) if accelerating else 0.0
    return Reading(
        "kl_acceleration", "mismatch_kl", value, ">=", cfg.kl_growth, value >= cfg.kl_growth,
        kl[0][0], kl[-1][0], f"thirds {m1:.3g} -> {m2:.3g} -> {m3:.3g}",
    )  # fmt: skip


def length_collapse(reward: Window, length: Window, cfg: HealthConfig) -> Reading | None:
    """Reward up by >= reward_rise while the mean completion length fell to <= length_drop of its first
    half; the value is the length ratio (second half / first)."""
    if len(reward) < cfg.window or len(length) < cfg.window:
        return None
    (r1, r2), (l1, l2) = _halves(reward), _halves(length)
    value = l2 / l1 if l1 > 0 else 1.0
    fired = r2 - r1 >= cfg.reward_rise and value <= cfg.length_drop
    return Reading(
        "length_collapse", "rollout/trained_completion_tokens/mean", value, "<=", cfg.length_drop, fired,
        length[0][0], length[-1][0], f"reward {r1:.3g} -> {r2:.3g}, length {l1:.3g} -> {l2:.3g} tokens",
    )  # fmt: skip


def one_component(env: str, reward: Window, parts: dict[str, Window], cfg: HealthConfig) -> Reading | None:
    """Env `env`'s reward rose by >= reward_rise and one of its reward functions made >= component_share
    of the rises of them all (unweighted scores; a falling one counts 0). Needs two or more."""
    full = {name: w for name, w in parts.items() if len(w) >= cfg.window}
    if len(reward) < cfg.window or len(full) < 2:
        return None
    r1, r2 = _halves(reward)
    rises = {name: max(b - a, 0.0) for name, (a, b) in ((n, _halves(w)) for n, w in full.items())}
    top = max(rises, key=lambda name: rises[name])
    total = sum(rises.values())
    value = rises[top] / total if total > 0 else 0.0
    fired = r2 - r1 >= cfg.reward_rise and value >= cfg.component_share
    return Reading(
        "one_component", f"env/{env}/reward_fn/{top}", value, ">=", cfg.component_share, fired,
        reward[0][0], reward[-1][0], f"reward {r1:.3g} -> {r2:.3g}, {top} made {value:.0%} of the rise",
    )  # fmt: skip


def ratio_drift(ratio: Window, cfg: HealthConfig) -> Reading | None:
    """The importance ratio's batch mean away from 1 over the window."""
    if len(ratio) < cfg.window:
        return None
    value = abs(_mean(ratio) - 1.0)
    return Reading(
        "ratio_drift", "ratio/mean", value, ">", cfg.ratio_drift, value > cfg.ratio_drift,
        ratio[0][0], ratio[-1][0], f"mean ratio {_mean(ratio):.4g}",
    )  # fmt: skip


def advantage_drift(mean: Window, abs_mean: Window, cfg: HealthConfig) -> Reading | None:
    """The loss tokens' mean advantage away from 0, relative to its scale (group-relative advantages have
    mean 0 per group; a token mean far from it pushes lengths one way)."""
    if len(mean) < cfg.window or len(abs_mean) < cfg.window:
        return None
    scale = _mean(abs_mean)
    value = abs(_mean(mean)) / scale if scale > 0 else 0.0
    return Reading(
        "advantage_drift", "batch/advantage/mean", value, ">", cfg.advantage_drift,
        value > cfg.advantage_drift, mean[0][0], mean[-1][0], f"mean {_mean(mean):.3g}, |mean| {scale:.3g}",
    )  # fmt: skip
