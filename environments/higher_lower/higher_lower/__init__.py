"""higher-lower: guess the number (verifiers v1 multi-turn environment, offline data).

Loaded by id (`higher-lower` or `higher_lower`): verifiers imports this package and takes the one `vf.Taskset`
subclass and the one `vf.Env` subclass exported in `__all__`.
"""

from __future__ import annotations

from higher_lower.env import (
    HigherLowerData,
    HigherLowerEnv,
    HigherLowerTask,
    HigherLowerTaskset,
    HigherLowerTasksetConfig,
    feedback,
    parse_guess,
)

__all__ = [
    "HigherLowerData",
    "HigherLowerEnv",
    "HigherLowerTask",
    "HigherLowerTaskset",
    "HigherLowerTasksetConfig",
    "feedback",
    "parse_guess",
]
