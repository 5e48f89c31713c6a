"""Packing of whole samples into rows and rows onto trainer ranks: the two bin-packing steps every batch
producer shares (the orchestrator's RL batches, `orchestrator/batching.py`; SFT batches, `sft/batches.py`).

Items are anything with a `num_tokens` (a sample, or a shared-prefix unit of several samples).

Invariants: every item lands in exactly one row, whole; a row holds <= `seq_len` tokens (an item longer
than that is the caller's error, raised as ValueError); every rank gets rows whose token totals differ by
at most the longest row (LPT), ties broken toward the rank with fewer rows.
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class Sized(Protocol):
    @property
    def num_tokens(self) -> int: ...


ItemT = TypeVar("ItemT", bound=Sized)


def pack_rows(items: list[ItemT], seq_len: int) -> list[list[ItemT]]:
    """First-fit decreasing: few rows, each of <= seq_len tokens."""
    rows: list[list[ItemT]] = []
    free: list[int] = []
    for item in sorted(items, key=lambda it: it.num_tokens, reverse=True):
        if item.num_tokens > seq_len:
            raise ValueError(f"a sample of {item.num_tokens} tokens does not fit seq_len = {seq_len}")
        for i, room in enumerate(free):
            if item.num_tokens <= room:
                rows[i].append(item)
                free[i] -= item.num_tokens
                break
        else:
            rows.append([item])
            free.append(seq_len - item.num_tokens)
    return rows


def row_tokens(row: list[ItemT]) -> int:
    return sum(it.num_tokens for it in row)


def balance_rows(rows: list[list[ItemT]], num_ranks: int) -> list[list[list[ItemT]]]:
    """Longest rows first onto the rank with the fewest tokens (LPT), ties to the fewest rows."""
    per_rank: list[list[list[ItemT]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for row in sorted(rows, key=row_tokens, reverse=True):
        rank = min(range(num_ranks), key=lambda i: (load[i], len(per_rank[i])))
        per_rank[rank].append(row)
        load[rank] += row_tokens(row)
    return per_rank
