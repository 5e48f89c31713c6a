"""Length bias: are the trained trajectories as long as the ones generated?

Staleness control drops groups that are too old (`dropped_stale`) and cancels in-flight groups that can
no longer ship (`cancelled`). Long episodes are the ones that age most while they generate, so what is
trained can be shorter than what the policy produces: a bias toward short answers that no loss term
shows. This module measures it, and warns only when the gap is beyond sampling noise.

    dispatcher: a finished group, after the sink's put ──finished(group, generated, accepted)──►
                a cancelled group (teacher scoring included) ──cancelled_group(group, partial)────►
    main loop:  every cut batch ──trained(groups)──► per env populations ──metrics() / warn_if_biased()

Unit: one trajectory (one trained seat of one verifiers episode), measured by `trajectory_length`: the
tokens the trajectory sampled (`Episode.metrics["sampled_tokens"]`, every turn and branch of its seat,
set by the rollout source; else its loss tokens), snapshotted when it is first counted so a later
truncation does not change it. A cancelled episode counts with the tokens it had sampled when cancelled
(`RolloutSource.take_cancelled_lengths`, per trajectory): a lower bound of its length. A trajectory that
sampled nothing (a seat without a turn, an episode cancelled before its first token) carries no length
and is counted in no population (`rollout/length/empty`).

Populations per env, each trajectory once:
- generated: every ok trajectory of a finished group, every finished trajectory of a cancelled group
  (its shorter, finished siblings) and every cancelled trajectory;
- filtered: what the sink removed before any staleness rule acted (errored groups, `reject_equal_reward`,
  overlong drops): never attributed to staleness;
- eligible = generated - filtered: the accepted groups and the cancelled ones;
- trained (a subset of eligible) and untrained = eligible - trained (dropped stale, cancelled, and the
  groups still buffered, which only dilute the gap).

`rollout/length_bias` = mean trained / mean eligible length (1.0 = none). The filters' own effect is
reported apart: `rollout/length_bias/filters` = mean eligible / mean generated, and
`rollout/length/filtered/share` = filtered / generated trajectories.

The bound: lengths are clustered by group (episodes of one prompt are alike, and a group is trained or
removed whole), so each population keeps per-group moments and the variance of its mean is the
cluster-robust (ratio-estimator) one. The difference d = mean trained - mean untrained has standard error
SE = sqrt(var trained + var untrained) (Welch, normal), and since mean eligible mixes the two,
bias - 1 = (n_untrained / n_eligible) * d / mean eligible; `rollout/length_bias/{low,high}` is that at
d -/+ `Z` SE. The warning (per env) fires when the whole interval lies below 1 - `MIN_EFFECT` (trained
shorter), with at least `MIN_GROUPS` trained and `MIN_GROUPS` untrained groups; once, and again each
time the high bound moves another `WARN_STEP` down. Trained longer is shown, never warned: cancelled
lengths are lower bounds, so that side can come from the measure itself (and staleness cuts the slow,
long episodes). The shorter side is conservative for the same reason.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode

logger = logging.getLogger(__name__)

Z = 3.0  # standard errors of the bound: checked every step, so a strict one
MIN_EFFECT = 0.02  # a bias whose bound does not clear 2% is not worth a warning, however certain
MIN_GROUPS = 8  # groups on each side before a bound is trusted (cluster variances of fewer are noise)
WARN_STEP = 0.10
WINDOW = 4096
SAMPLED = "sampled_tokens"


def trajectory_length(ep: Episode) -> int:
    """The tokens trajectory `ep` sampled (module docstring); snapshotted into `ep.metrics` on first use."""
    n = ep.metrics.get(SAMPLED)
    if n is None:
        n = ep.metrics[SAMPLED] = ep.num_completion_tokens
    return int(n)


@dataclass
class _Clusters:
    """One population's lengths as clusters (groups): n_g trajectories of total S_g each. Keeps what the
    mean and its cluster-robust variance need: G, sum n_g, sum S_g, sum S_g^2, sum S_g n_g, sum n_g^2."""

    groups: int = 0
    count: int = 0
    total: float = 0.0
    sq: float = 0.0
    cross: float = 0.0
    nsq: float = 0.0
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, lengths: Sequence[int]) -> None:
        """One cluster; an empty one adds nothing."""
        if not lengths:
            return
        n, s = len(lengths), float(sum(lengths))
        self.groups += 1
        self.count += n
        self.total += s
        self.sq += s * s
        self.cross += s * n
        self.nsq += n * n
        self.recent.extend(lengths)

    def merge(self, other: _Clusters, sign: int = 1) -> _Clusters:
        """self + other (sign 1) or self - other (sign -1), moments only."""
        return _Clusters(
            groups=self.groups + sign * other.groups, count=self.count + sign * other.count,
            total=self.total + sign * other.total, sq=self.sq + sign * other.sq,
            cross=self.cross + sign * other.cross, nsq=self.nsq + sign * other.nsq,
        )  # fmt: skip

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else 0.0

    def var_of_mean(self) -> float:
        """Cluster-robust variance of `mean`; inf with fewer than two clusters."""
        if self.groups < 2 or self.count <= 0:
            return math.inf
        m = self.mean
        ss = max(self.sq - 2 * m * self.cross + m * m * self.nsq, 0.0)
        return self.groups / (self.groups - 1) * ss / (self.count * self.count)


@dataclass
class _Env:
    generated: _Clusters = field(default_factory=_Clusters)
    filtered: _Clusters = field(default_factory=_Clusters)
    eligible: _Clusters = field(default_factory=_Clusters)
    cancelled: _Clusters = field(default_factory=_Clusters)
    trained: _Clusters = field(default_factory=_Clusters)
    empty: int = 0


@dataclass(frozen=True)
class Bias:
    """mean trained / mean eligible with its bound (`low`, `high`); `judged`: enough groups to trust it."""

    value: float
    low: float
    high: float
    judged: bool
    trained_mean: float
    untrained_mean: float
    untrained: int


def _bias(env: _Env) -> Bias | None:
    trained, eligible = env.trained, env.eligible
    if not trained.count or not eligible.count or eligible.mean == 0:
        return None
    value = trained.mean / eligible.mean
    untrained = eligible.merge(trained, -1)
    if untrained.count <= 0 or untrained.groups <= 0:  # everything eligible was trained: no gap to judge
        return Bias(value, value, value, False, trained.mean, 0.0, 0)
    d = trained.mean - untrained.mean
    scale = untrained.count / (eligible.count * eligible.mean)
    se = math.sqrt(trained.var_of_mean() + untrained.var_of_mean())
    low, high = (1 + scale * (d - Z * se), 1 + scale * (d + Z * se)) if math.isfinite(se) else (0.0, math.inf)
    judged = trained.groups >= MIN_GROUPS and untrained.groups >= MIN_GROUPS
    return Bias(value, low, high, judged, trained.mean, untrained.mean, untrained.count)


class LengthBias:
    """Trajectory lengths per env: generated, filtered, eligible, cancelled, trained (module docstring)."""

    def __init__(self) -> None:
        self._envs: dict[str, _Env] = {}
        self._warned_at: dict[str, float] = {}

    def _env(self, name: str) -> _Env:
        return self._envs.setdefault(name, _Env())

    def _lengths(self, env: _Env, episodes: Iterable[Episode]) -> list[int]:
        out = []
        for ep in episodes:
            if ep.status != "ok":
                continue
            if (n := trajectory_length(ep)) > 0:
                out.append(n)
            else:
                env.empty += 1
        return out

    def finished(self, group: Group, generated: list[Episode], *, accepted: bool) -> None:
        """A finished group: `generated`, its trajectories before the sink's put; `accepted`, whether the
        sink took it (then `group.episodes` are what it kept), else it dropped it whole."""
        env = self._env(group.env)
        lengths = self._lengths(env, generated)
        env.generated.add(lengths)
        kept = {id(ep) for ep in group.episodes} if accepted else set()
        env.filtered.add(_nonempty(ep for ep in generated if ep.status == "ok" and id(ep) not in kept))
        if accepted:
            env.eligible.add(_nonempty(group.episodes))

    def cancelled_group(self, group: Group, partial: Iterable[int]) -> None:
        """A group cancelled in flight or while the teacher scored it: its finished trajectories
        (`group.finished_by_index`) and `partial`, what its running trajectories had sampled."""
        env = self._env(group.env)
        finished = self._lengths(env, (ep for eps in group.finished_by_index.values() for ep in eps))
        running = [n for n in partial if n > 0]
        env.empty += sum(1 for n in partial if n <= 0)
        for table in (env.generated, env.eligible, env.cancelled):
            table.add(finished + running)

    def trained(self, groups: list[Group]) -> None:
        for group in groups:
            self._env(group.env).trained.add(_nonempty(group.episodes))

    def bias(self, env: str | None = None) -> Bias | None:
        """Mean trained / mean eligible length and its bound (of `env`, or of all); None before any."""
        return _bias(self._merged(env))

    def _merged(self, env: str | None) -> _Env:
        if env is not None:
            return self._envs.get(env, _Env())
        out = _Env()
        for e in self._envs.values():
            for name in ("generated", "filtered", "eligible", "cancelled", "trained"):
                merged = getattr(out, name).merge(getattr(e, name))
                merged.recent.extend(getattr(out, name).recent)
                merged.recent.extend(getattr(e, name).recent)
                setattr(out, name, merged)
            out.empty += e.empty
        return out

    def metrics(self) -> dict[str, float]:
        """`rollout/length/*`, `rollout/length_bias` (+ bound, filters) and per env (module docstring)."""
        out: dict[str, float] = {}
        merged = self._merged(None)
        for name in ("generated", "cancelled", "filtered", "trained"):
            table: _Clusters = getattr(merged, name)
            if table.count:
                p50, p90 = np.percentile(np.asarray(table.recent), [50, 90])
                out[f"rollout/length/{name}/mean"] = table.mean
                out[f"rollout/length/{name}/p50"] = float(p50)
                out[f"rollout/length/{name}/p90"] = float(p90)
        out["rollout/length/empty"] = float(merged.empty)
        if merged.generated.count:
            out["rollout/length/filtered/share"] = merged.filtered.count / merged.generated.count
            if merged.eligible.count and merged.generated.mean:
                out["rollout/length_bias/filters"] = merged.eligible.mean / merged.generated.mean
        out.update(_bias_metrics("rollout/length_bias", self.bias()))
        for env in self._envs:
            out.update(_bias_metrics(f"rollout/env/{env}/length_bias", self.bias(env)))
        return out

    def warn_if_biased(self) -> None:
        """Log the warning of the module docstring when it applies."""
        for env in self._envs:
            bias = self.bias(env)
            if bias is None or not bias.judged:
                continue
            near = 1 - bias.high  # how far below 1 the bias is at least
            if near <= MIN_EFFECT or near < self._warned_at.get(env, 0.0) + WARN_STEP:
                continue
            self._warned_at[env] = near
            logger.warning(
                "env %s: trained episodes are %.0f%% shorter than generated ones (at least %.0f%% at %g "
                "standard errors; mean %.1f tokens trained vs %.1f for the %d generated but not trained): "
                "staleness control biases training by length; a larger max_off_policy_steps or "
                "max_inflight_groups lowers it",
                env, 100 * (1 - bias.value), 100 * near, Z, bias.trained_mean, bias.untrained_mean,
                bias.untrained,
            )  # fmt: skip


def _nonempty(episodes: Iterable[Episode]) -> list[int]:
    return [n for ep in episodes if (n := trajectory_length(ep)) > 0]


def _bias_metrics(prefix: str, bias: Bias | None) -> dict[str, float]:
    if bias is None:
        return {}
    out = {prefix: bias.value}
    if math.isfinite(bias.high):
        out[f"{prefix}/low"], out[f"{prefix}/high"] = bias.low, bias.high
    return out
