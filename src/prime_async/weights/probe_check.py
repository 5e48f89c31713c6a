"""The orchestrator's side of the check after every weight load (`probe.py` has the figures).

    control channel: Published(N, probe=ref) ──► WeightProbe.remember(N, ref)
    WeightWatcher.update(N): load, resume generation ──► WeightProbe.check(N): every engine scores the
        probe (one batched scoring request each, concurrently with generation) ──► weights/probe_* and,
        beyond a threshold, one ERROR line naming the version (`on_mismatch = "stop"`: ProbeMismatch)

Invariants: a version without a reference (a lost announcement, LoRA, a backend without the probe) is
not checked and counts nothing; the figures of a window are the worst over the versions checked in it;
the probe never changes what an engine serves (scoring touches no cache, no running request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from prime_async.config.probe import WeightProbeConfig
from prime_async.engine_api import EngineUnavailable
from prime_async.weights.probe import ProbeFigures, ProbeReference, compare

logger = logging.getLogger(__name__)

KEEP_REFERENCES = 8  # versions announced but not yet loaded (a deterministic run loads K + 1 behind)


class ProbeMismatch(ValueError):
    """`weights.probe.on_mismatch = "stop"` and a loaded version failed the probe. A ValueError, so the
    entrypoint reports it as one line."""


class ProbeEngine(Protocol):
    """An engine that answers SGLang's scoring request with top logprobs (`HttpEngineClient`)."""

    async def score_top(
        self, sequences: list[list[int]], starts: list[int], top_n: int, *, temperature: float = 1.0
    ) -> list[tuple[list[float], list[dict[int, float]]]]: ...


def tops_at(ref: ProbeReference, tops: Sequence[Sequence[dict[int, float]]]) -> list[dict[int, float]]:
    """The engine's top-k at each of `ref.dists`' positions (`tops[i][j]`: sequence i, position j + 1)."""
    out = []
    for d in ref.dists:
        row = tops[d.seq] if d.seq < len(tops) else []
        out.append(row[d.pos - 1] if 0 < d.pos <= len(row) else {})
    return out


class WeightProbe:
    """Remembers each announced reference and checks a loaded version on every engine."""

    def __init__(
        self,
        cfg: WeightProbeConfig,
        engines: Sequence[ProbeEngine],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg, self.engines, self.clock = cfg, engines, clock  # a list the engine pool may grow
        self._refs: OrderedDict[int, ProbeReference] = OrderedDict()
        self._window: ProbeFigures | None = None
        self._time_s = 0.0

    def remember(self, version: int, ref: ProbeReference) -> None:
        """The trainer announced `version` with `ref` (called on the control channel's task)."""
        self._refs[version] = ref
        while len(self._refs) > KEEP_REFERENCES:
            self._refs.popitem(last=False)

    async def check(self, version: int) -> ProbeFigures | None:
        """Score the probe on every engine and compare (module docstring); None without a reference."""
        ref = self._refs.get(version)
        if ref is None:
            return None
        start = self.clock()
        try:
            answers = await asyncio.gather(*(self._score(e, ref) for e in self.engines))
        except EngineUnavailable:
            raise  # an outage: the watcher recovers (weights/engine_outage.py)
        except Exception as e:  # a probe never ends a run by failing itself: only its figures may
            logger.warning(
                "weights v%d: the weight probe could not be scored: %s: %s", version, type(e).__name__, e
            )
            return None
        figures = [compare(ref, lps, tops_at(ref, tops)) for lps, tops in answers]
        worst = figures[0]
        for f in figures[1:]:
            worst = worst.worse(f)
        self._time_s += self.clock() - start
        self._window = worst if self._window is None else self._window.worse(worst)
        self._judge(version, worst)
        return worst

    async def _score(self, engine: ProbeEngine, ref: ProbeReference):
        answers = await engine.score_top(
            ref.sequences, [1] * len(ref.sequences), ref.top_k, temperature=ref.temperature
        )
        return [lps for lps, _ in answers], [tops for _, tops in answers]

    def _judge(self, version: int, f: ProbeFigures) -> None:
        """One ERROR line naming the version when a figure is beyond its threshold; raise on "stop"."""
        c = self.cfg
        if f.max_abs_logprob_diff <= c.max_logprob_diff and f.kl <= c.max_kl and f.tv <= c.max_tv:
            return  # (NaN fails every comparison: a mismatch)
        line = (
            f"weights v{version}: the engines disagree with the trainer on the weight probe: max |logprob "
            f"diff| {f.max_abs_logprob_diff:.4g} (limit {c.max_logprob_diff}), KL {f.kl:.4g} (limit "
            f"{c.max_kl}), TV {f.tv:.4g} (limit {c.max_tv}): the load is corrupt or the engine computes "
            "another model (docs/weights.md, weight probe)"
        )
        logger.error(line)
        if c.on_mismatch == "stop":
            raise ProbeMismatch(line)

    def metrics(self) -> dict[str, float]:
        """`weights/probe_*` of the versions checked since the last call (worst of them; then reset)."""
        if self._window is None:
            return {}
        f, t = self._window, self._time_s
        self._window, self._time_s = None, 0.0
        return {
            "weights/probe_max_abs_logprob_diff": f.max_abs_logprob_diff,
            "weights/probe_kl": f.kl,
            "weights/probe_tv": f.tv,
            "weights/probe_time_s": t,
        }
