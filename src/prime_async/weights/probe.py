"""The check after every weight load: what the trainer sends, and how the engine's answer is compared.

    Trainer.publish(N) ──► ProbeReference (trainer/probe_reference.py: the trainer's own forward)
        ──► Published(N, probe=...) on the control channel (every transport announces there)
    WeightWatcher.update(N): load, resume ──► WeightProbe.check (probe_check.py): every engine scores the
        probe's sequences (sampled-token logprobs + top-k at `positions`) ──► compare() ──► weights/probe_*

Figures (`ProbeFigures`), the worst over the probe: `max_abs_logprob_diff` over every probe token; `kl`
(KL(trainer || engine)) and `tv` (total variation) at each compared position, over the trainer's top-k
tokens plus one bucket holding the rest of the mass (exact when top_k covers the vocabulary).

Invariants: a reference is built from exactly the weights announced with it; the probe's sequences are
fixed for a run (the same tokens at every version); a token of the trainer's top-k that the engine did
not return gets the engine's smallest returned probability (an upper bound: the figures never
overstate a mismatch there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

PROB_FLOOR = 1e-12


class ProbeDist(msgspec.Struct, frozen=True):
    """The trainer's top-k at position `pos` of sequence `seq`: the distribution of token `pos` given
    tokens [0, pos), at the probe's temperature."""

    seq: int
    pos: int
    ids: list[int]
    logprobs: list[float]


class ProbeReference(msgspec.Struct, frozen=True):
    """The trainer's logprobs of the probe for one version: `logprobs[i][j]` is token j + 1 of
    `sequences[i]` given the ones before it."""

    sequences: list[list[int]]
    logprobs: list[list[float]]
    dists: list[ProbeDist]
    top_k: int
    temperature: float = 1.0


@dataclass(frozen=True)
class ProbeFigures:
    """The worst engine-vs-trainer mismatch over the probe (see the module docstring)."""

    max_abs_logprob_diff: float
    kl: float
    tv: float

    def worse(self, other: ProbeFigures) -> ProbeFigures:
        return ProbeFigures(
            max(self.max_abs_logprob_diff, other.max_abs_logprob_diff),
            max(self.kl, other.kl),
            max(self.tv, other.tv),
        )


def max_abs_diff(reference: Sequence[Sequence[float]], engine: Sequence[Sequence[float]]) -> float:
    """Largest |engine - trainer| over every probe token (inf when the shapes differ or a value is not
    finite: an engine that answers garbage is a mismatch)."""
    if len(reference) != len(engine) or any(len(a) != len(b) for a, b in zip(reference, engine, strict=True)):
        return math.inf
    diffs = [
        abs(a - b) for ra, rb in zip(reference, engine, strict=True) for a, b in zip(ra, rb, strict=True)
    ]
    worst = max(diffs, default=0.0)
    return worst if math.isfinite(worst) else math.inf


def dist_divergence(trainer: ProbeDist, engine: dict[int, float]) -> tuple[float, float]:
    """(KL(trainer || engine), total variation) over the trainer's top-k tokens plus the rest bucket;
    `engine` is the engine's top-k {token id: logprob} at the same position."""
    if not engine:
        return math.inf, 1.0
    floor = math.exp(min(engine.values()))
    p = [math.exp(lp) for lp in trainer.logprobs]
    q = [math.exp(engine[t]) if t in engine else floor for t in trainer.ids]
    p.append(max(0.0, 1.0 - sum(p)))
    q.append(max(0.0, 1.0 - sum(q)))
    kl = sum(pi * math.log(pi / max(qi, PROB_FLOOR)) for pi, qi in zip(p, q, strict=True) if pi > 0)
    tv = 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q, strict=True))
    return max(kl, 0.0), min(tv, 1.0)


def compare(
    ref: ProbeReference, engine_logprobs: Sequence[Sequence[float]], engine_tops: Sequence[dict[int, float]]
) -> ProbeFigures:
    """The figures of one engine's answer: `engine_logprobs` as `ref.logprobs`, `engine_tops[i]` the
    engine's top-k at `ref.dists[i]`'s position."""
    if len(engine_tops) != len(ref.dists):
        return ProbeFigures(max_abs_diff(ref.logprobs, engine_logprobs), math.inf, 1.0)
    pairs = [dist_divergence(d, top) for d, top in zip(ref.dists, engine_tops, strict=True)]
    return ProbeFigures(
        max_abs_diff(ref.logprobs, engine_logprobs),
        max((kl for kl, _ in pairs), default=0.0),
        max((tv for _, tv in pairs), default=0.0),
    )
