"""Prompt source of the dispatcher: example ids in a seeded order, epoch by epoch, with a retry queue;
or, for an infinite taskset (`num_examples=None`), a stream 0, 1, 2, ... of drawn tasks.

Called by the dispatcher (`next_example`), the sink listener (`retry`) and the checkpoint code
(`state_dict` / `load_state_dict`). The rollout source's side of a stream is
`rollouts/tasks.py` (`LazyTasks`).

Invariants:
- within an epoch every example id is issued exactly once by the order, plus once per `retry`;
- retried prompts are issued before new ones (oldest retry first);
- `state_dict(pending=...)` + `load_state_dict` reissue the `pending` prompts (issued, not trained) first
  and then continue the order where it stopped: nothing is skipped and nothing issued twice, because the
  order position is saved after the pending prompts were taken from it;
- streamed (`num_examples=None`): `position` is the number of tasks drawn so far; ids are issued in
  draw order, epoch stays 0, and a resume continues at `position` (pending ones first, as above).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)


class DataSource:
    """Example ids `0..num_examples-1`, shuffled per epoch with `seed + epoch` when `shuffle`; with
    `num_examples=None` the unbounded stream `0, 1, 2, ...` (never shuffled)."""

    def __init__(self, *, num_examples: int | None, seed: int = 0, shuffle: bool = True):
        if num_examples is not None and num_examples < 1:
            raise ValueError(f"the environment has no examples (num_examples = {num_examples})")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._retry: deque[tuple[int, int]] = deque()
        self._order = self._make_order(0)

    @property
    def streamed(self) -> bool:
        return self.num_examples is None

    def _make_order(self, epoch: int) -> list[int]:
        if self.num_examples is None:
            return []
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_example(self) -> tuple[int, int]:
        """Return `(example_id, epoch)` of the next prompt to issue."""
        if self._retry:
            return self._retry.popleft()
        if self.num_examples is None:
            self.position += 1
            return self.position - 1, 0
        if self.position >= self.num_examples:
            self.epoch += 1
            self.position = 0
            self._order = self._make_order(self.epoch)
        example_id = self._order[self.position]
        self.position += 1
        return example_id, self.epoch

    def retry(self, example_id: int, epoch: int) -> None:
        """Put a prompt back: it is issued again before any new prompt."""
        self._retry.append((example_id, epoch))

    def unused_group(self, group: Any, *, retry: bool) -> None:
        """The group table's hook when this is its only prompt source: `retry` the `Group`'s prompt."""
        if retry:
            self.retry(group.example_id, group.epoch)

    @property
    def num_retry_pending(self) -> int:
        return len(self._retry)

    def state_dict(self, *, pending: Iterable[tuple[int, int]] = ()) -> dict[str, Any]:
        """Position + retry queue; `pending` (issued, not trained) prompts are saved as retries first."""
        retry = [list(p) for p in pending] + [list(p) for p in self._retry]
        return {
            "num_examples": self.num_examples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "retry": retry,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_examples"] != self.num_examples:
            raise ValueError(
                f"checkpoint was taken with {state['num_examples']} examples (None = streamed), the "
                f"environment has {self.num_examples}: resume with the same env config or start "
                "without --resume"
            )
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._make_order(self.epoch)
        self._retry = deque((int(e), int(ep)) for e, ep in state["retry"])
