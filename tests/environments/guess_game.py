"""A guess-the-number game as a verifiers environment (id `guess_game`), for the tests of multi-turn
episodes: the env answers every guess with "higher" or "lower" (and a filler sentence of `hint_words`
words, so later turns grow and can outgrow `seq_len`), until the number is hit or `max_turns` replies.

Loaded by id from `tests/environments` (on `sys.path` through its conftest). Reward: 1.0 when a reply
holds the number, else 0.0; metric `guesses`: the number of replies.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]

_NUMBER = re.compile(r"-?\d+")


class GuessData(vf.TaskData):
    number: int


def _guessed(text: str, number: int) -> bool:
    return any(int(found) == number for found in _NUMBER.findall(text or ""))


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def hit(self, task: GuessData, trace: vf.Trace) -> float:
        return float(any(_guessed(m.content or "", task.number) for m in trace.assistant_messages))

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessTasksetConfig(vf.TasksetConfig):
    num_examples: int = 8
    """How many games `load()` yields."""
    seed: int = 0
    """Seed of the secret numbers."""
    max_turns: int = 4
    """Replies of the policy per game."""
    hint_words: int = 40
    """Words of filler after each "higher"/"lower" (grows every turn's prompt)."""
    stop_on_hit: bool = True
    """End the game when a reply holds the number (False: always `max_turns` replies)."""


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self) -> Iterable[GuessTask]:
        rng = random.Random(self.config.seed)
        return [
            GuessTask(
                GuessData(id=f"guess-{i}", prompt="Guess my number (1-100).", number=rng.randint(1, 100)),
                self.config.task,
            )
            for i in range(self.config.num_examples)
        ]


class GuessEnv(vf.Env[vf.SingleAgentEnvConfig]):
    """One agent; the env answers each guess until it is hit or `max_turns` replies were made."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        cfg = self.taskset.config
        filler = " ".join(["keep"] * cfg.hint_words)
        async with agents.agent.interaction(task) as exchange:
            segment = await exchange.turn()
            for _ in range(cfg.max_turns - 1):
                if segment.terminated or (cfg.stop_on_hit and _guessed(segment.last_reply, task.data.number)):
                    break
                numbers = _NUMBER.findall(segment.last_reply or "")
                hint = "higher" if not numbers or int(numbers[-1]) < task.data.number else "lower"
                segment = await exchange.turn(f"{hint}. {filler}")
