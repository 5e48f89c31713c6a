"""Reward functions plugged into a taskset's config (`task.rewards.<name>.fn`) by the error-status tests."""

from __future__ import annotations


async def raising_reward(trace) -> float:
    raise RuntimeError("reward exploded")


async def nan_reward(trace) -> float:
    return float("nan")


async def none_reward(trace) -> float | None:
    return None
