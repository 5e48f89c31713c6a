"""The straggler budget: how long a batch that could be cut waits for a group still in flight.

Under the token rule (`sink.stragglers = "partial"`) a cut that does not wait leaves the straggler to a
later batch, where its tokens older than K are masked: waiting costs the trainer time, not waiting costs
tokens. `sink.straggler_wait_s` fixes the wait; left unset, this controller sets it so that the share of
generated loss tokens discarded as stale (masked at a cut, or in a group dropped stale) stays within
`sink.discard_budget`:

    wait = factor x (mean seconds between cuts)
    after each cut, over the last `WINDOW` cuts:  discarded share > budget      ->  factor += STEP_UP
                                                  discarded share < budget / 2  ->  factor *= DECAY

(additive increase of the wait while tokens are lost, multiplicative decrease while there is room: the
AIMD shape of a congestion window, turned around since waiting is the conservative side). The factor
stays in [0, MAX_FACTOR]: never more than a few steps of waiting for one group, so a hung episode does
not hold the run (the cut goes ahead; the episode's own deadline is the rollout source's).

Invariant: `seconds()` is finite and >= 0; it is 0 only while the discarded share is well inside the
budget. Logged as `rollout/straggler_wait_s` and `rollout/discarded_token_share` (the window's share).
"""

from __future__ import annotations

from collections import deque

WINDOW = 8
STEP_UP = 0.25
DECAY = 0.8
MAX_FACTOR = 4.0
START_FACTOR = 0.5


class StragglerBudget:
    """A fixed wait (`fixed_s`) or the adaptive one above; fed once per cut with the token ledger."""

    def __init__(self, *, fixed_s: float | None, discard_budget: float):
        self.fixed_s = fixed_s
        self.discard_budget = discard_budget
        self.factor = START_FACTOR
        self._cuts: deque[tuple[float, int, int]] = deque(maxlen=WINDOW + 1)  # (time, discarded, generated)

    def seconds(self) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        return self.factor * self._step_s()

    def observe(self, now: float, discarded: int, generated: int) -> None:
        """A cut at `now`; `discarded` / `generated`: the cumulative token ledger (stale ones, all)."""
        self._cuts.append((now, discarded, generated))
        share = self.share()
        if self.fixed_s is not None or share is None:
            return
        if share > self.discard_budget:
            self.factor = min(MAX_FACTOR, self.factor + STEP_UP)
        elif share < self.discard_budget / 2:
            self.factor *= DECAY

    def share(self) -> float | None:
        """Discarded / generated tokens over the window (None before two cuts or without tokens)."""
        if len(self._cuts) < 2:
            return None
        (_, d0, g0), (_, d1, g1) = self._cuts[0], self._cuts[-1]
        return (d1 - d0) / (g1 - g0) if g1 > g0 else None

    def _step_s(self) -> float:
        if len(self._cuts) < 2:
            return 0.0
        return (self._cuts[-1][0] - self._cuts[0][0]) / (len(self._cuts) - 1)

    def metrics(self) -> dict[str, float]:
        share = self.share()
        out = {"rollout/straggler_wait_s": self.seconds()}
        if share is not None:
            out["rollout/discarded_token_share"] = share
        return out
