"""The echo_long taskset: prompts, the heavy-tailed offline data generator and the similarity reward."""

from __future__ import annotations

import difflib
import random
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

    `autojunk` is off: with it, difflib ignores characters frequent in a target of 200+ characters (the
    space, `e`), which would score the long texts, the ones this environment is about, by a heuristic.
    """
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


def word_count(rng: random.Random, *, min_words: int, max_words: int, alpha: float) -> int:
    """A Pareto(alpha) word count scaled by `min_words`, cut at `max_words`: P(count >= w) = (min_words / w)
    ** alpha for `min_words` <= w <= `max_words`. With 3, 60 and 1.3 (the defaults): median 4-5 words
    (P(>= 5) = 0.51), p90 16, and 2% of the texts at the cap, 12-15x the median."""
    return min(max_words, int(min_words * rng.paretovariate(alpha)))


def make_examples(
    *, num_examples: int, seed: int, min_words: int = 3, max_words: int = 60, length_alpha: float = 1.3
) -> list[str]:
    """Deterministic texts of common words, each of a heavy-tailed length (`word_count`)."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words (got {min_words}, {max_words})")
    if length_alpha <= 0:
        raise ValueError(f"need length_alpha > 0 (got {length_alpha})")
    rng = random.Random(seed)
    texts = []
    for _ in range(num_examples):
        n = word_count(rng, min_words=min_words, max_words=max_words, alpha=length_alpha)
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    return texts


class EchoLongData(vf.TaskData):
    text: str
    """The text to repeat; it is also the target answer."""


class EchoLongTask(vf.Task[EchoLongData]):
    @vf.reward
    async def similarity(self, task: EchoLongData, trace: vf.Trace) -> float:
        return similarity(trace.last_reply.strip(), task.text)

    @vf.metric
    async def exact(self, task: EchoLongData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.text)

    @vf.metric
    async def words(self, task: EchoLongData) -> float:
        """The target's word count: the batch mean shows how much of the tail a step drew."""
        return float(len(task.text.split()))


class EchoLongTasksetConfig(vf.TasksetConfig):
    num_examples: int = Field(1000, ge=1)
    """How many examples `load()` yields."""
    seed: int = 0
    """Seed of the offline generator."""
    min_words: int = Field(3, ge=1)
    """Fewest words in a text, and the scale of the Pareto length."""
    max_words: int = Field(60, ge=1)
    """Most words in a text (the Pareto tail is cut here)."""
    length_alpha: float = Field(1.3, gt=0)
    """Pareto shape of the word count: smaller = heavier tail."""

    @model_validator(mode="after")
    def _check_words(self) -> EchoLongTasksetConfig:
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) > max_words ({self.max_words})")
        return self


class EchoLongTaskset(vf.Taskset[EchoLongTask, EchoLongTasksetConfig]):
    def load(self) -> Iterable[EchoLongTask]:
        cfg = self.config
        texts = make_examples(
            num_examples=cfg.num_examples,
            seed=cfg.seed,
            min_words=cfg.min_words,
            max_words=cfg.max_words,
            length_alpha=cfg.length_alpha,
        )
        return [
            EchoLongTask(
                EchoLongData(
                    id=f"long-{i}", prompt=PROMPT.format(text=text), system_prompt=SYSTEM_PROMPT, text=text
                ),
                self.config.task,
            )
            for i, text in enumerate(texts)
        ]
