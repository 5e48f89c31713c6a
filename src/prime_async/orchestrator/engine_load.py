"""`engine/busy_fraction`: how much of each step the training engines spent generating.

Each step the orchestrator asks every engine's `/get_server_info`; the embedded engine reports `busy_s`
(seconds its thread spent in prefill/decode steps since start) and `uptime_s`. The metric is the mean over
engines of d(busy_s) / d(uptime_s) since the previous step. SGLang reports neither: the metric is then
left out (never a made-up value). An engine that does not answer is skipped for that step.

A vision-language model's embedded engine also reports `vision_s` (seconds in its vision tower, part of
`busy_s`): `inference/vision_s` is the sum over engines of d(vision_s) since the previous step (left out
when no engine reports it: text models, SGLang). A restarted engine (counters going back) counts from its
restart on the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from prime_async.engine_api import EngineClient, EngineUnavailable
from prime_async.inference.client import EngineError


class EngineLoad:
    """`engine/busy_fraction` of `engines` (module docstring); `metrics()` once per step."""

    def __init__(self, engines: Sequence[EngineClient]):
        self.engines = engines  # the run's live list (engine_pool.py)
        self._last: dict[str, tuple[float, float]] = {}
        self._last_vision: dict[str, float] = {}

    async def metrics(self, timeout_s: float = 2.0) -> dict[str, float]:
        """`engine/busy_fraction` (and `inference/vision_s`) since the previous call; {} when no engine
        reports its counters."""
        engines = list(self.engines)  # the pool may change the live list while the answers come
        infos = await asyncio.gather(*(self._info(e, timeout_s) for e in engines))
        out = self._vision(engines, infos)
        fractions = []
        for engine, info in zip(engines, infos, strict=True):
            if not info or "busy_s" not in info or "uptime_s" not in info:
                continue
            now = (float(info["busy_s"]), float(info["uptime_s"]))
            last = self._last.get(engine.base_url)
            self._last[engine.base_url] = now
            if last is not None and now[1] > last[1] and now[0] >= last[0]:  # a restarted engine starts over
                fractions.append((now[0] - last[0]) / (now[1] - last[1]))
        if fractions:
            out["engine/busy_fraction"] = sum(fractions) / len(fractions)
        return out

    def _vision(
        self, engines: Sequence[EngineClient], infos: Sequence[dict[str, Any] | None]
    ) -> dict[str, float]:
        """`inference/vision_s`: the engines' vision-tower seconds since the previous call (module docstring);
        {} when none reports `vision_s`, or at the first call of every engine that does."""
        deltas = []
        for engine, info in zip(engines, infos, strict=True):
            if not info or "vision_s" not in info:
                continue
            now = float(info["vision_s"])
            last = self._last_vision.get(engine.base_url)
            self._last_vision[engine.base_url] = now
            if last is not None and now >= last:
                deltas.append(now - last)
        return {"inference/vision_s": sum(deltas)} if deltas else {}

    @staticmethod
    async def _info(engine: EngineClient, timeout_s: float) -> dict[str, Any] | None:
        with contextlib.suppress(EngineUnavailable, EngineError, TimeoutError):  # skipped this step
            return await asyncio.wait_for(engine.server_info(), timeout=timeout_s)
        return None
