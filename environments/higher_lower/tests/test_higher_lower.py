"""higher-lower: the game logic without a model, then real episodes on the tiny model through `eval`.

Run: `uv run pytest -n 0 <this directory>` (the episode test builds the tiny random model: about a
minute).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import verifiers.v1 as vf
from higher_lower import (
    HigherLowerData,
    HigherLowerTask,
    HigherLowerTaskset,
    HigherLowerTasksetConfig,
    feedback,
    parse_guess,
)


def test_feedback_points_to_the_secret() -> None:
    assert parse_guess("I guess 42.") == 42 and parse_guess("no idea") is None
    assert feedback(10, 42) == "Higher." and feedback(50, 42) == "Lower."
    assert "not a number" in feedback(None, 42)


def test_taskset_is_seeded_and_in_range() -> None:
    def secrets(seed: int) -> list[int]:
        tasks = HigherLowerTaskset(HigherLowerTasksetConfig(num_examples=8, seed=seed, low=1, high=10)).load()
        return [t.data.secret for t in tasks]

    assert secrets(0) == secrets(0) and all(1 <= s <= 10 for s in secrets(0))


class Replies:
    """The part of a `vf.Trace` the reward and the metric read."""

    def __init__(self, *replies: str) -> None:
        self.assistant_messages = [vf.AssistantMessage(content=r) for r in replies]


def test_reward_hits_only_the_secret() -> None:
    data = HigherLowerData(id="t", prompt="?", secret=7, max_guesses=4)
    task = HigherLowerTask(data)
    assert asyncio.run(task.hit(data, Replies("50", "7"))) == 1.0
    assert asyncio.run(task.hit(data, Replies("50", "8"))) == 0.0
    assert asyncio.run(task.guesses(Replies("50", "8"))) == 2.0


def test_episodes_on_the_tiny_model(tmp_path: Path) -> None:
    """4 episodes; the random model rarely hits, so most play every turn: the env's answers are there."""
    samples = run_eval(tmp_path)
    assert len(samples) == 4 and all(s["reward"] in (0.0, 1.0) for s in samples), samples
    assert any(word in s["completion"] for s in samples for word in ("Higher.", "Lower.", "not a number"))


EVAL_CONFIG = """
seq_len = 1024
output_dir = "{out}"
[model]
path = "{model}"
build = "tiny"
[wandb]
enabled = false
[sampling]
max_tokens = 8
[[envs]]
id = "higher-lower"
args = {{ num_examples = 2 }}
rollouts_per_example = 2
"""


def run_eval(tmp_path: Path) -> list[dict]:
    """`eval` on the tiny model (built into tmp_path; its engine a child process): the samples."""
    out, config = tmp_path / "eval", tmp_path / "eval.toml"
    config.write_text(EVAL_CONFIG.format(out=out, model=tmp_path / "tiny"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "prime_async.entrypoints.eval", "@", str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "eval" / "samples_v0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
