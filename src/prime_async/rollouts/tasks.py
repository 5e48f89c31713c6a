"""The tasks of an environment's taskset, by example id: a list for a finite taskset, `LazyTasks` for a
stream that may never end (`INFINITE`), drawn only as example ids reach them.

Invariant: `LazyTasks[i]` is the i-th task the taskset's iterator yields, whenever it is asked (a
rewind re-reads the stream from the start), so a retry or a resume gets the same task for the same id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class LazyTasks:
    """Task `i` of an iterable that may never end, drawn on demand.

    `tasks()` makes a fresh iterator over the taskset (verifiers' `Taskset.__iter__`, deterministic
    for a seeded `load()`). Ids are usually asked in increasing order, so reading goes forward once;
    the last `cache_size` drawn tasks are kept for retries, and an older id (a retry after a resume)
    re-reads the stream from the start up to it.
    """

    def __init__(self, tasks: Callable[[], Iterable[Any]], *, cache_size: int = 4096):
        self._make = tasks
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._cache_size = cache_size
        self._it: Iterator[Any] = iter(tasks())
        self._next = 0  # index of the task `_it` yields next
        self.num_rewinds = 0

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            raise IndexError(f"task index {index} < 0")
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        if index < self._next:
            self._it, self._next = iter(self._make()), 0
            self.num_rewinds += 1
        while self._next <= index:
            try:
                task = next(self._it)
            except StopIteration:
                raise IndexError(f"the taskset ended after {self._next} tasks (asked for {index})") from None
            self._remember(self._next, task)
            self._next += 1
        return self._cache[index]

    def _remember(self, index: int, task: Any) -> None:
        self._cache[index] = task
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
