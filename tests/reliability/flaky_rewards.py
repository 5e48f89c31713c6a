"""A reward function that faults on a fixed schedule of calls: raise, NaN, None (then 13 good rewards).

Plugged into reverse-text as `task.rewards.lcs.fn` by test_env_faults.py; the schedule is a module-level
counter, so which episode faults depends only on call order (deterministic for one process).
"""

from __future__ import annotations

import itertools

CALLS = itertools.count()
FAULTS = {0: "raise", 5: "nan", 10: "none"}
PERIOD = 16


async def flaky_reward(trace) -> float | None:
    kind = FAULTS.get(next(CALLS) % PERIOD)
    if kind == "raise":
        raise RuntimeError("reward exploded")
    if kind == "nan":
        return float("nan")
    if kind == "none":
        return None
    return 1.0 if next(CALLS) % 2 else 0.0  # varied rewards: groups are not all filtered as zero-advantage
