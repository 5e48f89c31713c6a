"""`metrics/episodes.jsonl`: one line per finished episode (trajectory), for length distributions.

Written by the dispatcher when a group finishes, before the sink decides its fate; the line's `group` id
joins it with the batches that trained it. Fields: time, env, group, example, dispatch_version,
finish_version, status, turns, tokens (prompt + completion), completion_tokens, seconds (wall time of
the episode), reward, and the env's own values: `metrics` (each `@vf.metric`) and `rewards` (each reward
function's unweighted score), by the env's names (`rollouts/episode.env_values`; empty when none was
computed), and `overflow_turn` (the turn that did not fit `seq_len`, or null). Benchmarks
(`scripts/bench_agentic.py`) read the p50 / p90 / p99 of turns, tokens and seconds from it.

Invariants: one line per trajectory of every finished group, in finish order, flushed per line (a
killed orchestrator loses at most the line being written); never read back by the run itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prime_async.orchestrator.types import Group
from prime_async.rollouts.episode import split_env_values


class EpisodeLog:
    def __init__(self, output_dir: Path):
        path = Path(output_dir) / "metrics" / "episodes.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def write_group(self, group: Group) -> None:
        now = time.time()
        for ep in group.episodes:
            metrics, rewards = split_env_values(ep.metrics)
            record = {
                "time": now, "env": group.env, "group": group.group_id, "example": ep.example_id,
                "dispatch_version": group.dispatch_version,
                "finish_version": ep.span.end if ep.span is not None else None, "status": ep.status,
                "turns": ep.metrics.get("num_turns"), "tokens": len(ep.token_ids),
                "completion_tokens": ep.num_completion_tokens, "seconds": ep.metrics.get("episode_seconds"),
                "reward": ep.reward, "metrics": metrics, "rewards": rewards,
                "overflow_turn": ep.metrics.get("overflow_turn"),
            }  # fmt: skip
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
