"""lookup_agent: the agentic benchmark environment (verifiers v1 Env over an offline seeded taskset).

An episode looks up `len(records)` records, a Pareto-distributed count: per record the environment calls
the `lookup` tool over MCP (a lognormal latency, heavy-tailed), hands its result to the model, and the model
answers with the record's code. Reward `codes`: the mean similarity of each reply to its code (difflib
ratio, 1.0 iff exact), so a 135M instruct model starts partly right and improves, as on echo_text. The
episode's length in turns, tokens and wall time therefore has the long tail of agentic tasks, set by the
config, not by the policy.

Loaded by id (`lookup-agent`); exports one `vf.Taskset` and its `vf.Env` in `__all__`.

Invariants: the same seed and config give the same corpus, tasks, lookup counts and latencies (no
download, no global RNG); every reward is in [0, 1].
"""

from __future__ import annotations

from lookup_agent.corpus import call_latency, lookups_per_task, make_corpus
from lookup_agent.env import LookupEnv, LookupEnvConfig, LookupTask, LookupTaskset, similarity

__all__ = [
    "LookupEnv",
    "LookupEnvConfig",
    "LookupTask",
    "LookupTaskset",
    "call_latency",
    "lookups_per_task",
    "make_corpus",
    "similarity",
]
