"""reverse_text: reverse a short string (verifiers v1 Taskset, data generated offline).

Loaded by id (`reverse-text` / `reverse_text`) through verifiers' loaders, which find the one
`vf.Taskset` subclass exported in `__all__`.

Invariants: the same `seed` and `num_examples` give the same tasks in the same order (no download, no
global RNG); the reward is the longest-common-subsequence ratio of the answer against the reversed
text, always in [0, 1].
"""

from __future__ import annotations

from reverse_text.taskset import ReverseTextTask, ReverseTextTaskset, lcs_ratio, make_examples

__all__ = ["ReverseTextTask", "ReverseTextTaskset", "lcs_ratio", "make_examples"]
