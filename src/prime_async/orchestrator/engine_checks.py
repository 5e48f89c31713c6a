"""Checks on the inference engines before the orchestrator uses them: alive, ours, not ahead of the run.

`check_served_not_ahead` is where the invariant "staleness n - d >= 0" is enforced at start: an engine may
never serve a version newer than the first batch this orchestrator cuts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from prime_async.inference.types import EngineClient


async def wait_for_engines(engines: Sequence[EngineClient], *, timeout_s: float) -> None:
    """Poll `/health` of every engine until all answer (the launcher starts inference first)."""
    deadline = time.monotonic() + timeout_s
    while not all(await asyncio.gather(*(e.health() for e in engines))):
        if time.monotonic() > deadline:
            urls = [e.base_url for e in engines]
            raise RuntimeError(f"inference engines {urls} not healthy after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


def check_served_not_ahead(served_version: int, start_step: int) -> None:
    """Staleness `n - d` must never be negative: an engine serving a version newer than the first batch
    this orchestrator cuts holds weights of a discarded history (e.g. a restart that did not reload it)."""
    if served_version > start_step:
        raise RuntimeError(
            f"an engine serves weight version {served_version} but this orchestrator starts at step "
            f"{start_step}: its groups would have staleness < 0; reload the engines with version {start_step}"
        )


async def check_engines_belong_to_run(engines: Sequence[Any], run_id: str | None) -> None:
    """Refuse (RuntimeError) an engine that reports another run's id: its weights are not ours, and our
    weight updates must never reach it. Engines that report no id (SGLang) are checked by the launcher."""
    if run_id is None:
        return
    for engine in engines:
        reported = (await engine.model_info()).get("run_id")
        if reported is not None and reported != run_id:
            raise RuntimeError(f"the engine at {engine.base_url} belongs to run {reported}, not to {run_id}")
