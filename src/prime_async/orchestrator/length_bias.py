"""Length bias: are the trained episodes as long as the episodes generated?

Staleness control drops groups that are too old (`dropped_stale`) and cancels in-flight groups that can
no longer ship (`cancelled`). Long episodes are the ones that age most while they generate, so what is
trained can be shorter than what the policy produces: a bias toward short answers that no loss term
shows. This module measures it.

    dispatcher: every finished group's ok episodes ──finished()──► per env: completion lengths
    rollout sources: every cancelled episode        ──cancelled()─► per env: tokens sampled when cancelled
    main loop:  every cut batch's ok episodes       ──trained()───► per env: completion lengths
                                                     metrics()  ──► rollout/length_bias (+ per env), quantiles

The generated population is the finished episodes plus the cancelled ones. A cancelled episode counts with
the tokens it had sampled when it was cancelled (the gateway waits for the aborted request's partial
output): a lower bound of its length, so the bias shown is a lower bound of the true one. Without them
the bias would be hidden exactly where it is largest: cancelled episodes are the ones still running when
their group could no longer ship, the long ones.

Metrics (over the lifetime of the orchestrator): `rollout/length/{finished,cancelled,trained}/{mean,p50,
p90}` and `rollout/length_bias` = mean trained length / mean generated length (1.0 = no bias), and per env
`rollout/env/<name>/length_bias`. The quantiles are over the newest `WINDOW` episodes of each population.
A warning is logged when an env's bias is off 1 by more than `WARN_FRACTION` while groups were dropped
as stale or cancelled (the cause this measures); once, and again each time it grows by another
`WARN_FRACTION`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from prime_async.orchestrator.types import Group

logger = logging.getLogger(__name__)

WARN_FRACTION = 0.10
WINDOW = 4096
MIN_TRAINED = 8  # episodes trained before a bias is judged


@dataclass
class _Lengths:
    total: int = 0
    count: int = 0
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, lengths: Iterable[int]) -> None:
        for n in lengths:
            self.total += n
            self.count += 1
            self.recent.append(n)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def _ok_lengths(groups: Iterable[Group]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for group in groups:
        out.setdefault(group.env, []).extend(
            ep.num_completion_tokens for ep in group.episodes if ep.status == "ok"
        )
    return out


class LengthBias:
    """Completion lengths of finished vs trained episodes, per env (module docstring)."""

    def __init__(self) -> None:
        self._finished: dict[str, _Lengths] = {}
        self._cancelled: dict[str, _Lengths] = {}
        self._trained: dict[str, _Lengths] = {}
        self._warned_at: dict[str, float] = {}

    def finished(self, group: Group) -> None:
        for env, lengths in _ok_lengths([group]).items():
            self._finished.setdefault(env, _Lengths()).add(lengths)

    def cancelled(self, env: str, lengths: Iterable[int]) -> None:
        """Episodes of `env` cancelled after sampling `lengths` tokens each."""
        self._cancelled.setdefault(env, _Lengths()).add(lengths)

    def trained(self, groups: list[Group]) -> None:
        for env, lengths in _ok_lengths(groups).items():
            self._trained.setdefault(env, _Lengths()).add(lengths)

    def generated(self, env: str | None = None) -> _Lengths:
        """Finished and cancelled episodes together (of `env`, or of all)."""
        finished, cancelled = self._merged(self._finished, env), self._merged(self._cancelled, env)
        return _Lengths(total=finished.total + cancelled.total, count=finished.count + cancelled.count)

    def bias(self, env: str | None = None) -> float | None:
        """Mean trained / mean generated length (of `env`, or of all); None before anything finished."""
        generated = self.generated(env)
        trained = self._merged(self._trained, env)
        if not generated.count or not trained.count or generated.mean == 0:
            return None
        return trained.mean / generated.mean

    @staticmethod
    def _merged(table: dict[str, _Lengths], env: str | None) -> _Lengths:
        if env is not None:
            return table.get(env, _Lengths())
        out = _Lengths()
        for lengths in table.values():
            out.total, out.count = out.total + lengths.total, out.count + lengths.count
            out.recent.extend(lengths.recent)
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        tables = (("finished", self._finished), ("cancelled", self._cancelled), ("trained", self._trained))
        for name, table in tables:
            merged = self._merged(table, None)
            if merged.count:
                p50, p90 = np.percentile(np.asarray(merged.recent), [50, 90])
                out[f"rollout/length/{name}/mean"] = merged.mean
                out[f"rollout/length/{name}/p50"] = float(p50)
                out[f"rollout/length/{name}/p90"] = float(p90)
        if (bias := self.bias()) is not None:
            out["rollout/length_bias"] = bias
        for env in self._finished.keys() | self._cancelled.keys():
            if (bias := self.bias(env)) is not None:
                out[f"rollout/env/{env}/length_bias"] = bias
        return out

    def warn_if_biased(self, *, stale_or_cancelled: int) -> None:
        """Log the warning of the module docstring when it applies."""
        if not stale_or_cancelled:
            return
        for env in self._finished.keys() | self._cancelled.keys():
            bias = self.bias(env)
            if bias is None or self._trained[env].count < MIN_TRAINED:
                continue
            off = abs(bias - 1.0)
            if off > WARN_FRACTION and off >= self._warned_at.get(env, 0.0) + WARN_FRACTION:
                self._warned_at[env] = off
                logger.warning(
                    "env %s: trained episodes are %.0f%% %s than generated ones (mean %.1f vs %.1f tokens; "
                    "%d episodes dropped as stale or cancelled so far): staleness control biases training "
                    "by length; a larger max_off_policy_steps or max_inflight_groups lowers it",
                    env, 100 * off, "shorter" if bias < 1 else "longer", self._trained[env].mean,
                    self.generated(env).mean, stale_or_cancelled,
                )  # fmt: skip
