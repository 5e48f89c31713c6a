"""The fixed dispatch schedule of `deterministic = true`: which group is dispatched when, and with which
sampling seeds, so that two runs of one config and seed produce the same batches.

    slot s (0, 1, 2, ...) ──► batch n = s // batch_groups ──► dispatched at version d(n) = max(c, n - K)
    (c = the step the run started or resumed at: after a rollback the engines serve exactly version c,
    and the older versions batches c .. c + K - 1 were scheduled for are gone)

Who calls it (only when `deterministic = true`): admission (`blocked`: the next slot waits for its
version), the dispatcher (`take_slot`: the slot is the group's id; `episode_seed`), the deterministic
sink (`batch_dispatched`, `slots`: batch n is exactly the groups of its slots, in slot order) and the
weight watcher (`wait_loadable`: version v is loaded only once every slot scheduled before it was
dispatched; the watcher then drains, so no group ever sees two versions).

Invariants:
- slots are taken in increasing order, one per dispatched group, and never past batch `max_steps - 1`;
- a slot of batch n is dispatched exactly when version d(n) is served: earlier is refused (`blocked`),
  later cannot happen (`wait_loadable` keeps d(n) + 1 out until the slot is taken) and raises if seen;
- hence every group of batch n has staleness exactly `min(n - c, K)` and is trained in batch n;
- seeds are functions of the run seed and the episode's identity (env, example, epoch, index in its
  group, model call in the episode), never of timing: `derive_seed` is a stable 63-bit hash.
"""

from __future__ import annotations

import asyncio


class DeterministicSchedule:
    """Slot counter of the fixed schedule (see the module docstring)."""

    def __init__(
        self, *, batch_groups: int, max_off_policy_steps: int, max_steps: int, seed: int, start_step: int = 0
    ):
        self.batch_groups = batch_groups
        self.k = max_off_policy_steps
        self.max_steps = max_steps
        self.seed = seed
        self.start_step = start_step
        self.next_slot = start_step * batch_groups
        self.advanced = asyncio.Event()

    def step_of(self, slot: int) -> int:
        return slot // self.batch_groups

    def dispatch_version(self, step: int) -> int:
        """The version the groups of batch `step` are dispatched at."""
        return max(self.start_step, step - self.k)

    def slots(self, step: int) -> range:
        return range(step * self.batch_groups, (step + 1) * self.batch_groups)

    def next_version(self) -> int | None:
        """Dispatch version of the next slot; None once every batch of the run is dispatched."""
        step = self.step_of(self.next_slot)
        return None if step >= self.max_steps else self.dispatch_version(step)

    def blocked(self, served_version: int) -> bool:
        """Whether the next slot must wait (for its version, or forever once the run is dispatched)."""
        version = self.next_version()
        if version is not None and version < served_version:
            raise RuntimeError(
                f"deterministic schedule broken: slot {self.next_slot} (batch "
                f"{self.step_of(self.next_slot)}) belongs to version {version} but the engines already "
                f"serve {served_version}"
            )
        return version is None or version > served_version

    def take_slot(self) -> int:
        """The next slot (the new group's id); wakes `wait_loadable`."""
        slot = self.next_slot
        self.next_slot += 1
        self.advanced.set()
        return slot

    def batch_dispatched(self, step: int) -> bool:
        return self.next_slot >= (step + 1) * self.batch_groups

    def loadable(self, version: int) -> bool:
        """Version `version` may be served once no slot scheduled for an older version is left."""
        nxt = self.next_version()
        return nxt is None or nxt >= version

    async def wait_loadable(self, version: int) -> None:
        while not self.loadable(version):
            self.advanced.clear()
            await self.advanced.wait()
