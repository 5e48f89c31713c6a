"""Orchestrator side of `weights.transport = "shared"`: one version's load, no process group, no torch.

    load(version) (the watcher has cancelled, paused or drained already):
      Lend(version, copies = engines) ──► trainer rank 0 ── done, one SharedVersion per engine (refused
                                                            with VERSION_GONE: `VersionGone`, the newest)
      /update_weights_from_tensor(SharedVersion i, weight_version, flush_cache) on engine i, concurrently:
                                                            each maps the buffer, copies, answers
      GiveBack(version)               ──► trainer ── done   (also when an engine failed)

Invariants: only announced versions are loaded; the trainer keeps a lent version until `GiveBack`, and
the give-back is sent only after every engine answered (each has finished copying by then; a load cut
short gives nothing back: the trainer's next Lend ends that lease), so no engine reads memory the
trainer freed; the version label reaches an engine in the same call as its weights.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from prime_async.config.shared import WeightsConfig
from prime_async.weights.control import VERSION_GONE, ControlServer, GiveBack, Lend, Published, Refused
from prime_async.weights.loaders.base import Announced, VersionGone

logger = logging.getLogger(__name__)


class SharedLoader:
    """`WeightLoader` over versions the trainer lends in shared memory (`weights/shared_memory.py`)."""

    def __init__(self, control: ControlServer, cfg: WeightsConfig, *, keep_announced: int):
        self.control, self.cfg, self.keep_announced = control, cfg, keep_announced
        self._announced: Announced[None] = Announced(keep_announced)

    def on_published(self, msg: Published) -> None:
        self._announced.add(msg.version, None)

    def latest(self) -> int | None:
        return self._announced.latest()

    def engines_restarted(self) -> bool:
        """Nothing to rebuild: a restarted engine maps the next version it is lent (it starts with the
        initial model, so it is given the run's weights first)."""
        return True

    async def load(self, engines: Sequence[Any], version: int, *, flush_cache: bool) -> None:
        self._announced.get(version)  # raises for a version never announced
        await self.control.wait_trainer(self.cfg.timeout_s)
        request = self.control.open_request(lambda rid: Lend(rid, version, len(engines)))
        try:
            reply = await request.reply("done", self.cfg.timeout_s)
        except Refused as e:
            if VERSION_GONE in str(e):
                raise VersionGone(str(e)) from e
            raise
        finally:
            request.close()
        if len(reply.shares) != len(engines):
            raise RuntimeError(f"trainer lent v{version} {len(reply.shares)}x for {len(engines)} engines")
        results = await asyncio.gather(
            *(
                e.update_weights_from_shared(share, weight_version=version, flush_cache=flush_cache)
                for e, share in zip(engines, reply.shares, strict=True)
            ),
            return_exceptions=True,
        )  # every engine answered (or failed): none is still copying
        await self._give_back(version)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _give_back(self, version: int) -> None:
        request = self.control.open_request(lambda rid: GiveBack(rid, version))
        try:
            await request.reply("done", self.cfg.timeout_s)
        finally:
            request.close()
