"""The reverse_text taskset: prompts, offline data generator and the LCS-ratio reward."""

from __future__ import annotations

import random
import string
from collections.abc import Iterable

import verifiers.v1 as vf

SYSTEM_PROMPT = "Reverse the text character by character. Answer with the reversed text only."
_WORD_TEXT = (
    "the a of to and in is it you that was for on are with as be at one have this from or had by "
    "word but what some can out other were all there when up use your how said each which do time "
    "will way about many then write would like so long make thing see two has look more day could "
    "go come did number sound people over know water call first who may down side now find text"
)
_WORDS = _WORD_TEXT.split()


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of `a` and `b` (O(len(a) * len(b)), one row)."""
    if not a or not b:
        return 0
    row = [0] * (len(b) + 1)
    for ch in a:
        prev_diag = 0
        for j, other in enumerate(b, start=1):
            prev_row = row[j]
            row[j] = prev_diag + 1 if ch == other else max(row[j], row[j - 1])
            prev_diag = prev_row
    return row[-1]


def lcs_ratio(answer: str, target: str) -> float:
    """2 * LCS / (len(answer) + len(target)), in [0, 1]; 1.0 iff equal, 0.0 if either is empty."""
    total = len(answer) + len(target)
    return 0.0 if total == 0 else 2.0 * lcs_length(answer, target) / total


def make_examples(*, num_examples: int, seed: int, min_words: int = 1, max_words: int = 3) -> list[str]:
    """Deterministic short texts: a few common words, sometimes a random lowercase token."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_examples):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        if rng.random() < 0.3:
            words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))))
        texts.append(" ".join(words))
    return texts


class ReverseTextData(vf.TaskData):
    text: str
    """The text to reverse; the target answer is `text[::-1]`."""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward
    async def lcs(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply.strip(), task.text[::-1])

    @vf.metric
    async def exact(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.text[::-1])


class ReverseTextTasksetConfig(vf.TasksetConfig):
    num_examples: int = 1000
    """How many examples `load()` yields."""
    seed: int = 0
    """Seed of the offline generator."""


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextTasksetConfig]):
    def load(self) -> Iterable[ReverseTextTask]:
        texts = make_examples(num_examples=self.config.num_examples, seed=self.config.seed)
        return [
            ReverseTextTask(
                ReverseTextData(id=f"reverse-{i}", prompt=text, system_prompt=SYSTEM_PROMPT, text=text),
                self.config.task,
            )
            for i, text in enumerate(texts)
        ]
