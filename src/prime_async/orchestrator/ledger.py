"""Episode ledger: every dispatched episode sits in exactly one bucket.

    dispatched = inflight + buffered + trained + dropped_stale + filtered + errored + cancelled

Components report transitions (`move(n, src, dst)`); the main loop calls `check(...)` every step with the
counts it observes directly (episodes of groups in the dispatcher, episodes in the sink), so the ledger
is checked against reality, not only against itself.

Invariants: no bucket ever goes negative (a transition from an empty bucket is a programming error and
raises AssertionError); `check` raises RuntimeError when the buckets do not add up or disagree with the
observed counts.
"""

from __future__ import annotations

import logging
from typing import Literal

logger = logging.getLogger(__name__)

Bucket = Literal["inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled"]
BUCKETS: tuple[Bucket, ...] = (
    "inflight",
    "buffered",
    "trained",
    "dropped_stale",
    "filtered",
    "errored",
    "cancelled",
)


class Ledger:
    """Cumulative episode counts per bucket."""

    def __init__(self) -> None:
        self.dispatched = 0
        self.counts: dict[str, int] = dict.fromkeys(BUCKETS, 0)

    def dispatch(self, n: int) -> None:
        self.dispatched += n
        self.counts["inflight"] += n

    def move(self, n: int, src: Bucket, dst: Bucket) -> None:
        assert n >= 0, f"negative ledger move {n}"
        assert self.counts[src] >= n, f"ledger: moving {n} episodes out of {src} ({self.counts[src]})"
        self.counts[src] -= n
        self.counts[dst] += n

    def check(self, *, inflight: int, buffered: int) -> None:
        """Raise RuntimeError unless the buckets add up and match the observed in-flight/buffered counts."""
        total = sum(self.counts.values())
        if total != self.dispatched:
            raise RuntimeError(f"episode ledger unbalanced: dispatched {self.dispatched} != {self.counts}")
        if self.counts["inflight"] != inflight or self.counts["buffered"] != buffered:
            raise RuntimeError(
                f"episode ledger disagrees with the components: ledger inflight={self.counts['inflight']} "
                f"buffered={self.counts['buffered']}, observed inflight={inflight} buffered={buffered}"
            )

    def metrics(self) -> dict[str, float]:
        out = {f"ledger/{k}": float(v) for k, v in self.counts.items()}
        out["ledger/dispatched"] = float(self.dispatched)
        return out
