"""The word_chain game: infinite taskset, the two-seat env loop, and the per-seat chain score."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

LETTERS = "abcdefghilmnoprstw"
SYSTEM_PROMPT = (
    "We play word chain. Answer with one English word that starts with the required letter: the last "
    "letter of the other player's word. Answer with the word only."
)
_WORD_TEXT = (
    "apple bread cloud dream eagle flame grape house igloo lemon mango night ocean piano queen river "
    "stone table umbrella violin water yellow zebra arrow bottle candle desert earth forest garden "
    "honey island jacket kettle ladder mirror needle orange pencil rabbit silver tiger window"
)
_WORDS = _WORD_TEXT.split()


def make_letters(seed: int) -> Iterator[str]:
    """The endless, seeded sequence of opening letters."""
    rng = random.Random(seed)
    while True:
        yield rng.choice(LETTERS)


def first_word(text: str) -> str:
    """The reply's first whitespace token, lowercased, stripped of surrounding punctuation."""
    tokens = text.strip().split()
    return tokens[0].strip(".,;:!?\"'()[]").lower() if tokens else ""


def word_score(reply: str, letter: str) -> float:
    """1.0 for an alphabetic word of >= 2 letters starting with `letter`; else partial credit: half
    the fraction of letters among the reply's first token (so even a random policy gets a signal)."""
    word = first_word(reply)
    if len(word) >= 2 and word.isalpha() and word.startswith(letter):
        return 1.0
    return 0.5 * sum(c.isalpha() for c in word) / len(word) if word else 0.0


def is_word(reply: str) -> bool:
    """Whether the reply parses as a move: its first token is alphabetic, at least 2 letters."""
    word = first_word(reply)
    return len(word) >= 2 and word.isalpha()


def _next_letter(word: str, fallback: str) -> str:
    letters = [c for c in word if c.isalpha()]
    return letters[-1] if letters else fallback


def scripted_word(letter: str, turn: int) -> str:
    """The scripted opponent's word for `letter` (the `turn`-th of the list's matches, cycling)."""
    matches = [w for w in _WORDS if w.startswith(letter)] or [letter * 3]
    return matches[turn % len(matches)]


def chain_score(messages: list[tuple[str, str]], opening_letter: str, prompt: str | None) -> float:
    """Mean `word_score` of the assistant replies of one seat's conversation `(role, text)`: each
    reply must start with the last letter of the opponent word it answers (the opening letter for a
    reply to the task prompt)."""
    letter, scores = opening_letter, []
    for role, text in messages:
        if role == "user" and text != prompt:
            letter = _next_letter(first_word(text), letter)
        elif role == "assistant":
            scores.append(word_score(text, letter))
    return sum(scores) / len(scores) if scores else 0.0


class WordChainData(vf.TaskData):
    letter: str
    """The opening letter (the first seat's first word must start with it)."""


class WordChainTask(vf.Task[WordChainData]):
    @vf.reward
    async def chain(self, task: WordChainData, trace: vf.Trace) -> float:
        branches = trace.branches
        messages = branches[-1].messages if branches else []
        pairs = [(m.role, m.content if isinstance(m.content, str) else "") for m in messages]
        return chain_score(pairs, task.letter, task.prompt if isinstance(task.prompt, str) else None)


class WordChainTasksetConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the opening letters."""


class WordChainTaskset(vf.Taskset[WordChainTask, WordChainTasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[WordChainTask]:
        for i, letter in enumerate(make_letters(self.config.seed)):
            data = WordChainData(
                id=f"chain-{i}",
                prompt=f"Your word must start with '{letter}'.",
                system_prompt=SYSTEM_PROMPT,
                letter=letter,
            )
            yield WordChainTask(data, self.config.task)


class WordChainEnvConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    """The opening seat."""
    second: vf.AgentConfig = vf.AgentConfig()
    """The answering seat (not run when `opponent = "script"`)."""
    rounds: int = Field(2, ge=1, le=8)
    """Words per seat."""
    opponent: Literal["seat", "script"] = "seat"
    """`seat`: both seats are played by agents; `script`: the env answers `first` from a word list."""
    forfeit: bool = False
    """A reply that does not parse as a word (`is_word`) forfeits: the game ends there. When `first`'s
    opening move does not parse, `second` never acts (its trace has no model call)."""


class WordChainEnv(vf.Env[WordChainEnvConfig]):
    """Two seats alternating words; or one seat against a scripted opponent."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        if self.config.opponent == "script":
            await self._run_scripted(task, agents)
            return
        answer_task = type(task)(task.data.model_copy(update={"prompt": None}), task.config)
        async with (
            agents.first.interaction(task) as first,
            agents.second.interaction(answer_task) as second,
        ):
            segment = await first.turn()
            for turn in range(2 * self.config.rounds - 1):
                if segment.terminated or self._forfeits(segment.last_reply):
                    break
                player = second if turn % 2 == 0 else first
                segment = await player.turn(segment.last_reply or "(no word)")

    async def _run_scripted(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.first.interaction(task) as first:
            segment = await first.turn()
            for turn in range(self.config.rounds - 1):
                if segment.terminated or self._forfeits(segment.last_reply):
                    break
                letter = _next_letter(first_word(segment.last_reply), task.data.letter)
                segment = await first.turn(scripted_word(letter, turn))

    def _forfeits(self, reply: str | None) -> bool:
        return self.config.forfeit and not is_word(reply or "")
