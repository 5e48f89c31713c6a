"""Shipping plan: every live group keeps a batch it can still be trained in.

A group dispatched at version `d` can be trained in batches `next_batch_step .. d + K`; `d + K` is its
*deadline*. The live groups (in flight and buffered) are *feasible* when, sorted by deadline, the i-th has

    deadline_i >= next_batch_step + i // batch_groups

that is, taking `batch_groups` groups per batch earliest deadline first, every live group is trained by its
deadline. Two rules keep the live groups feasible, and so nothing that is dispatched is ever cancelled or
dropped as stale:

- admission (`admission.py`, reason `off_policy`): a new group, whose deadline `served + K` is the largest
  of all, is admitted only when the batch it lands in, `next_batch_step + live // batch_groups`, is within
  K of the served version (`lands_in` below);
- the cut (`train_sink.py`): batch `step` takes finished groups earliest deadline first, and waits for a
  group still in flight rather than cut a batch that leaves the other live groups infeasible
  (`leaves_feasible`), whenever waiting can keep them feasible.

What can still end a group untrained: its episodes errored, a filter dropped it, the served version went
back (a rollback), or an in-flight group was passed over because waiting could not save every deadline
(then the earliest deadlines win). Those are counted in `ledger/*` as before; the simulator's property
test (`tests/orchestrator/test_shipping_property.py`) checks that none of them happens otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable


def lands_in(next_batch_step: int, live_groups: int, batch_groups: int) -> int:
    """The batch a group admitted now is trained in at the latest, when groups ship by deadline."""
    return next_batch_step + live_groups // batch_groups


def feasible(deadlines: Iterable[int], first_batch: int, batch_groups: int) -> bool:
    """Whether groups with these deadlines can all ship, `batch_groups` a batch from batch `first_batch`."""
    return all(d >= first_batch + i // batch_groups for i, d in enumerate(sorted(deadlines)))
