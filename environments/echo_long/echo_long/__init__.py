"""echo_long: repeat a text whose length is heavy-tailed (verifiers v1 Taskset, data generated offline).

The echo_text task with a long tail in generation length: a text's word count is Pareto-distributed, so
most answers are a few tokens and a few are 10-20x longer. Each episode is one model turn with no tool
and no wait, so the tail of the episode's wall time is the policy's own decoding (compute-bound), where
lookup_agent's is the tool's latency. Loaded by id (`echo-long` / `echo_long`) through verifiers' loaders,
which find the one `vf.Taskset` subclass exported in `__all__`.

Invariants: the same `seed`, `num_examples` and length parameters give the same tasks in the same order
(no download, no global RNG); every text has `min_words`..`max_words` words; the reward is difflib's
similarity ratio of the stripped answer against the text, always in [0, 1], 1.0 iff they are equal.
"""

from __future__ import annotations

from echo_long.taskset import EchoLongTask, EchoLongTaskset, make_examples, similarity, word_count

__all__ = ["EchoLongTask", "EchoLongTaskset", "make_examples", "similarity", "word_count"]
