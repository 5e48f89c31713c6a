"""higher-lower: guess the number, a multi-turn game (taskset, task with reward and metric, env).

The model guesses a secret whole number; after each wrong guess the env answers "Higher." or "Lower."
(or asks for a number), until a guess hits or `max_guesses` guesses are used. Reward `hit`: 1.0 when a
guess equals the number. Metric `guesses`: the model turns the episode used.

Invariants: the same `seed` gives the same secrets in the same order (no download, no global RNG); the
reward is 1.0 or 0.0; the env never makes more than `max_guesses` model turns.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf
from pydantic import Field, model_validator

SYSTEM_PROMPT = (
    "I picked a whole number. Guess it: answer with one number only. After each wrong guess I tell you "
    "whether my number is higher or lower."
)
_NUMBER = re.compile(r"-?\d+")


def parse_guess(reply: str) -> int | None:
    """The first whole number in `reply`, or None."""
    match = _NUMBER.search(reply)
    return int(match.group()) if match else None


def feedback(guess: int | None, secret: int) -> str:
    """The env's answer to a guess that missed: "Higher." or "Lower.", or a request for a number."""
    if guess is None:
        return "That is not a number. Answer with one number."
    return "Higher." if secret > guess else "Lower."


class HigherLowerData(vf.TaskData):
    """One task. `id`, `prompt` and `system_prompt` come from `vf.TaskData`; the env reads the fields
    below as `task.data.secret`, a reward as `task.secret` (its `task` argument is this object)."""

    secret: int
    """The number to guess."""
    max_guesses: int
    """Model turns allowed."""


class HigherLowerTask(vf.Task[HigherLowerData]):
    """Scores one episode's trace: `@vf.reward` methods are summed (weight 1.0 each) into the reward,
    `@vf.metric` methods are reported beside it."""

    @vf.reward
    async def hit(self, task: HigherLowerData, trace: vf.Trace) -> float:
        """1.0 when one of the model's guesses is the number."""
        guesses = [parse_guess(m.content or "") for m in trace.assistant_messages]
        return float(task.secret in guesses)

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        """Model turns used: fewer is better once the model plays well."""
        return float(len(trace.assistant_messages))


class HigherLowerTasksetConfig(vf.TasksetConfig):
    """The taskset's args (`[orchestrator.env] args = { ... }`); `task` (inherited) configures each task."""

    num_examples: int = Field(1000, ge=1)
    """How many tasks `load()` yields."""
    seed: int = 0
    """Seed of the secrets."""
    low: int = 1
    """Smallest secret."""
    high: int = 100
    """Largest secret."""
    max_guesses: int = Field(4, ge=1)
    """Model turns per episode: every turn's prompt holds the earlier ones, so keep the whole episode
    within seq_len."""

    @model_validator(mode="after")
    def _check(self) -> HigherLowerTasksetConfig:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) > high ({self.high})")
        return self


class HigherLowerTaskset(vf.Taskset[HigherLowerTask, HigherLowerTasksetConfig]):
    def load(self) -> Iterable[HigherLowerTask]:
        cfg = self.config
        rng = random.Random(cfg.seed)
        tasks = []
        for i in range(cfg.num_examples):
            data = HigherLowerData(
                id=f"higher_lower-{i}",
                prompt=f"My number is between {cfg.low} and {cfg.high}. Your guess?",
                system_prompt=SYSTEM_PROMPT,
                secret=rng.randint(cfg.low, cfg.high),
                max_guesses=cfg.max_guesses,
            )
            tasks.append(HigherLowerTask(data, cfg.task))  # cfg.task: the task's config (vf.TaskConfig)
        return tasks


class HigherLowerEnv(vf.Env[vf.SingleAgentEnvConfig]):
    """One seat (`agent`); the env answers each guess until a hit or `max_guesses` turns."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        data = task.data
        async with agents.agent.interaction(task) as player:
            segment = await player.turn()  # the model answers the task's prompt
            for _ in range(data.max_guesses - 1):
                guess = parse_guess(segment.last_reply)
                if segment.terminated or guess == data.secret:
                    break
                segment = await player.turn(feedback(guess, data.secret))  # a user turn, then the model's
