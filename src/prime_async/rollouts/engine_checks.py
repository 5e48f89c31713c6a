"""Checks on the inference engines before the orchestrator uses them: alive, ours, not ahead of the run.

`check_served_not_ahead` is where the invariant "staleness n - d >= 0" is enforced at start: an engine may
never serve a version newer than the first batch this orchestrator cuts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prime_async.engine_api import EngineClient


async def wait_for_engines(engines: Sequence[EngineClient], *, timeout_s: float) -> None:
    """Poll `/health` of every engine until all answer (the launcher starts inference and the orchestrator
    together; the orchestrator loads its environments meanwhile)."""
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


async def check_engines_belong_to_run(
    engines: Sequence[Any], run_id: str | None, *, model_path: str | None = None,
    broadcasts: Path | None = None,
) -> None:  # fmt: skip
    """Refuse (RuntimeError) an engine that is not this run's, before any request reaches it: one that
    reports another run's id (its weights are not ours, and our weight updates must never reach it), or,
    when it reports no id (SGLang), one that serves neither `model_path` nor a version of this run's
    `broadcasts` (a restarted engine serves `broadcasts/step_N`): another server answers on the port. The
    launcher makes the same check at start, so the orchestrator may start with the engines."""
    if run_id is None:
        return
    for engine in engines:
        info = await engine.model_info()
        reported = info.get("run_id")
        if reported is not None and reported != run_id:
            raise RuntimeError(f"the engine at {engine.base_url} belongs to run {reported}, not to {run_id}")
        served = str(info.get("model_path"))
        ours = served == model_path or (broadcasts is not None and Path(served).parent == Path(broadcasts))
        if reported is None and model_path is not None and not ours:
            raise RuntimeError(
                f"the engine at {engine.base_url} serves {served!r}, not this run's model "
                f"{model_path!r}: another server answers on its port"
            )
