"""A deliberately broken reward for the doctor's test: it ignores the episode and draws a random number
(the kind of bug a reward that samples a judge or reads the clock has)."""

from __future__ import annotations

import random


async def random_reward(trace) -> float:
    return random.random()
