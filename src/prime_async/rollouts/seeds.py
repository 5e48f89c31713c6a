"""Sampling seeds of deterministic runs: pure functions of the run seed and an episode's identity.

Invariant: a seed never depends on timing or process: `derive_seed` is a stable 63-bit hash of its parts'
`repr`s, so every process (and every rerun) derives the same seed for the same episode and model call.
The dispatcher seeds an episode with `episode_seed`; the gateway derives each model call's seed from it
with `call_seed` (`orchestrator/schedule.py` says when each slot is dispatched).
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A stable non-negative 63-bit seed from `parts` (their `repr`s), the same in every process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def episode_seed(run_seed: int, env: str, example_id: int, epoch: int, index: int) -> int:
    """Sampling seed of episode `index` of a group of `example_id` (epoch `epoch`) of env `env`."""
    return derive_seed("episode", run_seed, env, example_id, epoch, index)


def call_seed(episode: int, call: int) -> int:
    """`sampling_seed` of the `call`-th model call (0, 1, ...) of the episode seeded `episode`."""
    return derive_seed("call", episode, call)
