"""The seeded offline corpus, the heavy-tailed number of lookups per task, and each call's latency.

Invariants: every function is a pure function of its arguments (string-seeded `random.Random`, no global
RNG, no download); latencies are in (0, latency_max_s]; lookups per task in [min_calls, max_calls].
"""

from __future__ import annotations

import math
import random

_WORD_TEXT = (
    "amber basin cedar delta ember fjord grove harbor inlet jasper kestrel lagoon meadow nectar orchid "
    "pebble quartz raven summit thistle umber valley willow yarrow zephyr anchor beacon copper drift "
    "falcon glacier hollow iris juniper lantern marble north opal prairie ridge sable timber vesper"
)
_WORDS = _WORD_TEXT.split()


def make_corpus(size: int, seed: int) -> dict[str, str]:
    """`size` records: id `R0000`.. -> a code of two corpus words and a number (e.g. "cedar lagoon 41")."""
    rng = random.Random(f"corpus:{seed}")
    return {
        f"R{i:04d}": f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {rng.randint(10, 99)}" for i in range(size)
    }


def lookups_per_task(rng: random.Random, *, min_calls: int, max_calls: int, alpha: float) -> int:
    """A Pareto(alpha) count shifted to start at `min_calls`, cut at `max_calls`: most tasks need one or two
    lookups, a few need many (P(count >= min_calls + n) = (n + 1) ** -alpha)."""
    return min(max_calls, min_calls - 1 + int(rng.paretovariate(alpha)))


def call_latency(seed: int, task_id: str, call: int, *, median_s: float, sigma: float, max_s: float) -> float:
    """The latency of lookup `call` of task `task_id`: lognormal with median `median_s` and shape `sigma`
    (p90 = median * e^(1.28 sigma), p99 = median * e^(2.33 sigma)), cut at `max_s`."""
    rng = random.Random(f"latency:{seed}:{task_id}:{call}")
    return min(max_s, rng.lognormvariate(math.log(median_s), sigma))
