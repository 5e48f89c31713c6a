"""The orchestrator side of a weight transport: the `WeightLoader` protocol and what loaders share.

    WeightWatcher (after cancel, pause or drain) ──► loader.load(engines, version, flush_cache)
    control channel: Published(version) ──► loader.on_published(msg) ──► the watcher wakes
    engine outage recovered ──► loader.engines_restarted(): True = reload the run's weights first

Invariants: `load` brings every engine to `version` (and labels it so) or raises; it raises
`VersionGone` when the source no longer holds that version (newer ones replaced it); `latest()` is the
newest version announced (or, for the broadcast directory, complete: STABLE written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from prime_async.engine_api import EngineClient
from prime_async.weights.control import Published

KEEP_ANNOUNCED = 4  # at least; a deterministic run remembers K + 2 (it loads every version in turn)

T = TypeVar("T")


class VersionGone(RuntimeError):
    """`WeightLoader.load`: the source no longer holds that version (newer ones replaced it)."""


class WeightLoader(Protocol):
    """Where versions come from and how they reach the engines (one implementation per transport)."""

    def latest(self) -> int | None: ...

    def on_published(self, msg: Published) -> None:
        """The trainer announced `msg.version` (called on the control channel's task)."""
        ...

    async def load(self, engines: Sequence[EngineClient], version: int, *, flush_cache: bool) -> None: ...

    def engines_restarted(self) -> bool:
        """An engine outage ended; True when the restarted engines start from the initial model and must
        be given the run's weights before the held model calls go on."""
        ...


class Announced(Generic[T]):
    """The newest `keep` announced versions, each with what its announcement carried."""

    def __init__(self, keep: int):
        self.keep = keep
        self._held: OrderedDict[int, T] = OrderedDict()

    def add(self, version: int, value: T) -> None:
        self._held[version] = value
        while len(self._held) > self.keep:
            self._held.popitem(last=False)

    def latest(self) -> int | None:
        return next(reversed(self._held), None)

    def get(self, version: int) -> T:
        """What `version`'s announcement carried; RuntimeError when it was never announced (or forgotten)."""
        if version not in self._held:
            raise RuntimeError(f"weights v{version} were never announced by the trainer")
        return self._held[version]
