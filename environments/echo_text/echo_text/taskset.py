"""The echo_text taskset: prompts, offline data generator and the difflib-similarity reward."""

from __future__ import annotations

import difflib
import random
import string
from collections.abc import Iterable

import verifiers.v1 as vf
from pydantic import Field, model_validator

SYSTEM_PROMPT = "Repeat the user's text exactly. Answer with the text only."
PROMPT = 'Repeat this text: "{text}"'
"""The user turn; the target is `text` itself, without the quotes."""
_WORD_TEXT = (
    "the a of to and in is it you that was for on are with as be at one have this from or had by "
    "word but what some can out other were all there when up use your how said each which do time "
    "will way about many then write would like so long make thing see two has look more day could "
    "go come did number sound people over know water call first who may down side now find text"
)
_WORDS = _WORD_TEXT.split()


def similarity(answer: str, target: str) -> float:
    """difflib's ratio 2 * matches / (len(answer) + len(target)), in [0, 1]; 1.0 iff equal (both empty: 1.0).

    `autojunk` is off so long answers are not scored by a heuristic that ignores frequent characters.
    """
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


def make_examples(
    *, num_examples: int, seed: int, min_words: int = 2, max_words: int = 4, random_token_p: float = 0.3
) -> list[str]:
    """Deterministic short texts: `min_words`..`max_words` common words, sometimes one random token."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words (got {min_words}, {max_words})")
    rng = random.Random(seed)
    texts = []
    for _ in range(num_examples):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        if rng.random() < random_token_p:
            words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))))
        texts.append(" ".join(words))
    return texts


class EchoTextData(vf.TaskData):
    text: str
    """The text to repeat; it is also the target answer."""


class EchoTextTask(vf.Task[EchoTextData]):
    @vf.reward
    async def similarity(self, task: EchoTextData, trace: vf.Trace) -> float:
        return similarity(trace.last_reply.strip(), task.text)

    @vf.metric
    async def exact(self, task: EchoTextData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.text)


class EchoTextTasksetConfig(vf.TasksetConfig):
    num_examples: int = Field(1000, ge=1)
    """How many examples `load()` yields."""
    seed: int = 0
    """Seed of the offline generator."""
    min_words: int = Field(2, ge=1)
    """Fewest common words in a text."""
    max_words: int = Field(4, ge=1)
    """Most common words in a text (one random token may be added)."""
    random_token_p: float = Field(0.3, ge=0.0, le=1.0)
    """Probability that a text ends with a random lowercase token."""

    @model_validator(mode="after")
    def _check_words(self) -> EchoTextTasksetConfig:
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) > max_words ({self.max_words})")
        return self


class EchoTextTaskset(vf.Taskset[EchoTextTask, EchoTextTasksetConfig]):
    def load(self) -> Iterable[EchoTextTask]:
        cfg = self.config
        texts = make_examples(
            num_examples=cfg.num_examples,
            seed=cfg.seed,
            min_words=cfg.min_words,
            max_words=cfg.max_words,
            random_token_p=cfg.random_token_p,
        )
        return [
            EchoTextTask(
                EchoTextData(
                    id=f"echo-{i}", prompt=PROMPT.format(text=text), system_prompt=SYSTEM_PROMPT, text=text
                ),
                self.config.task,
            )
            for i, text in enumerate(texts)
        ]
