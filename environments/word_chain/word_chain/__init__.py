"""word_chain: a two-seat word game (verifiers v1 multi-agent Env over an infinite offline taskset).

Seats `first` and `second` take turns: `first` opens with a word starting with the task's letter,
then each player answers the other's word with a word starting with that word's last letter, for
`rounds` words each. Each seat's trace is scored on its own replies (`chain_score`), so both seats are
trained, each with its own reward. With `forfeit = true` a reply that is not a word ends the
game (the other seat may never act). With `opponent = "script"` the environment plays `second` itself
from a fixed word list: a single-seat multi-turn episode against a scripted user.

Loaded by id (`word-chain`); exports one `vf.Taskset` and its `vf.Env` in `__all__`.

Invariants: the taskset is infinite (`INFINITE = True`, `load()` a seeded generator: the same seed
gives the same tasks in the same order, no download); every reward is in [0, 1].
"""

from __future__ import annotations

from word_chain.game import (
    WordChainEnv,
    WordChainEnvConfig,
    WordChainTask,
    WordChainTaskset,
    chain_score,
    first_word,
    is_word,
    make_letters,
    scripted_word,
    word_score,
)

__all__ = [
    "WordChainEnv",
    "WordChainEnvConfig",
    "WordChainTask",
    "WordChainTaskset",
    "chain_score",
    "first_word",
    "is_word",
    "make_letters",
    "scripted_word",
    "word_score",
]
