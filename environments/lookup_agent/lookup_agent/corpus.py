"""The seeded offline corpus, the heavy-tailed number of lookups per task, and each call's latency.

Invariants: every function is a pure function of its arguments (string-seeded `random.Random`, no global
RNG, no download); latencies are in (0, latency_max_s]; lookups per task in [min_calls, max_calls].
"""

from __future__ import annotations

import math
import random

_WORD_TEXT = (
    "the a of to and in is it you that was for on are with as be at one have this from or had by word but "
    "what some can out other were all there when up use your how said each which do time will way about "
    "many then write would like so long make thing see two has look more day could go come did number "
    "sound people over know water call first who may down side now find text"
)
_WORDS = _WORD_TEXT.split()


def make_corpus(size: int, seed: int) -> dict[str, str]:
    """`size` records: id `R0000`.. -> a code of two to four common words (e.g. "water side know")."""
    rng = random.Random(f"corpus:{seed}")
    return {f"R{i:04d}": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 4))) for i in range(size)}


def lookups_per_task(rng: random.Random, *, min_calls: int, max_calls: int, alpha: float) -> int:
    """A Pareto(alpha) count shifted to start at `min_calls`, cut at `max_calls`: most tasks need one or two
    lookups, a few need many (P(count >= min_calls + n) = (n + 1) ** -alpha)."""
    return min(max_calls, min_calls - 1 + int(rng.paretovariate(alpha)))


def call_latency(seed: int, task_id: str, call: int, *, median_s: float, sigma: float, max_s: float) -> float:
    """The latency of lookup `call` of task `task_id`: lognormal with median `median_s` and shape `sigma`
    (p90 = median * e^(1.28 sigma), p99 = median * e^(2.33 sigma)), cut at `max_s`."""
    rng = random.Random(f"latency:{seed}:{task_id}:{call}")
    return min(max_s, rng.lognormvariate(math.log(median_s), sigma))
