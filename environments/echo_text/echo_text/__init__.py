"""echo_text: repeat a short text given in the prompt (verifiers v1 Taskset, data generated offline).

The demo task: a 135M instruct model starts partially right (it echoes the text but wraps it in chatter,
quotes or changes it) and learns within minutes to answer with the text only. Loaded by id (`echo-text` /
`echo_text`) through verifiers' loaders, which find the one `vf.Taskset` subclass exported in `__all__`.

Invariants: the same `seed`, `num_examples` and word bounds give the same tasks in the same order (no
download, no global RNG); the reward is difflib's similarity ratio of the stripped answer against the text,
always in [0, 1], 1.0 iff they are equal.
"""

from __future__ import annotations

from echo_text.taskset import EchoTextTask, EchoTextTaskset, make_examples, similarity

__all__ = ["EchoTextTask", "EchoTextTaskset", "make_examples", "similarity"]
