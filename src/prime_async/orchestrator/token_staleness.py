"""Token-level staleness: which loss tokens of a group batch `n` may train, and masking the rest.

With `sink.stragglers = "partial"` the bound K applies to every trained token, not to the group's dispatch
version: batch `n` trains a loss token sampled under version `v` only if `n - v <= K`. A group that
outlived its dispatch deadline (a straggler: it kept generating, under the newer weights the engines
loaded meanwhile, while the batches it could have joined were cut without it) lands in a later batch
with its old tokens masked (`mask_stale`) and counted; its newer tokens train under the importance-ratio
correction like any off-policy token.

Invariants:
- a loss token whose version is unknown (-1) is taken to be of the group's dispatch version, the oldest
  it can be: it is masked as soon as that version is past K;
- `mask_stale(group, n)` leaves exactly the tokens of `trainable_tokens(group, n)` in the loss, so after
  it no loss token of the group has `n - v > K` (what `TrainSink` sends and the trainer re-checks with
  `oldest_trained_version`);
- `effective_deadline(group, n)`: the last batch in which the group still trains every loss token it
  has that batch `n` may train; for a group of one version it is `dispatch_version + K`, as with
  `stragglers = "wait"`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


def _loss_versions(ep: Episode, dispatch_version: int) -> Iterator[tuple[int, int]]:
    """(position, version) of each loss token of `ep`; unknown versions count as `dispatch_version`."""
    versions = ep.token_versions
    for i, m in enumerate(ep.loss_mask):
        if m:
            v = versions[i] if i < len(versions) else -1
            yield i, v if v >= 0 else dispatch_version


def loss_tokens(group: Group) -> int:
    """Loss tokens of the group's episodes (the tokens it sampled that a batch would train)."""
    return sum(sum(1 for m in ep.loss_mask if m) for ep in group.episodes)


def trainable_tokens(group: Group, step: int, k: int) -> int:
    """Loss tokens batch `step` may train: sampled under a version `v` with `step - v <= k`."""
    d = group.dispatch_version
    return sum(1 for ep in group.episodes for _, v in _loss_versions(ep, d) if step - v <= k)


def effective_deadline(group: Group, step: int, k: int) -> int:
    """The last batch that trains every loss token batch `step` may still train (see module doc)."""
    d = group.dispatch_version
    fresh = [v for ep in group.episodes for _, v in _loss_versions(ep, d) if step - v <= k]
    return (min(fresh) if fresh else d) + k


def expiring_share(group: Group, step: int, k: int) -> float:
    """The share of the tokens batch `step` may train that batch `step + 1` may not (what passing the group
    over now costs, as a share: 1.0 for a group of one version at its deadline, less for a straggler)."""
    d = group.dispatch_version
    fresh = [v for ep in group.episodes for _, v in _loss_versions(ep, d) if step - v <= k]
    return sum(step + 1 - v > k for v in fresh) / len(fresh) if fresh else 0.0


def mask_stale(group: Group, step: int, k: int) -> int:
    """Take every loss token older than K for batch `step` out of the loss; return how many."""
    d = group.dispatch_version
    masked = 0
    for ep in group.episodes:
        stale = [i for i, v in _loss_versions(ep, d) if step - v > k]
        if stale:
            mask = list(ep.loss_mask)
            for i in stale:
                mask[i] = False
            ep.loss_mask = mask
            masked += len(stale)
    return masked


def loss_token_ages(group: Group, step: int) -> list[int]:
    """`step - v` of every loss token of the group (unknown versions at the dispatch version)."""
    d = group.dispatch_version
    return [step - v for ep in group.episodes for _, v in _loss_versions(ep, d)]


def oldest_trained_version(group: Group, step: int, k: int) -> int:
    """The oldest version a loss token of `group` may have once `mask_stale(group, step, k)` ran: its
    dispatch version, or `step - k` for a straggler whose older tokens were masked."""
    return max(group.dispatch_version, step - k)
