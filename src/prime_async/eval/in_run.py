"""Evaluation while training: which versions are evaluated, when, and on which engines.

    InRunEval.run()  (a supervised background task of the orchestrator's main loop)
      shared:     wait until the training engines serve a due version, take the weight watcher's pin
                  (a weight update now waits), evaluate at the served version, release the pin
      dedicated / external:
                  wait until a due version has a STABLE broadcast, load it into the eval engines
                  (`/update_weights_from_disk`), evaluate; training engines are never touched
      ──► on_result(EvalResult)  (the orchestrator logs `eval/*` against the version, writes samples)
    InRunEval.finish()  (the main loop, after the last batch): waits until the final version is evaluated

Due versions: 0 (`at_start`), every multiple of `interval` up to `max_steps`, and `max_steps` (`at_end`),
each only if not older than the version the run (re)started at.

Invariants:
- shared: every eval token is sampled under the version the eval is recorded at: the pin is the weight
  watcher's update lock, held for the whole eval, and the version is read after taking it;
- an eval runs at the newest version that is due and available; older due versions passed meanwhile are
  skipped (counted in `eval/skipped_versions`), so a slow eval never falls further behind;
- dedicated / external: every evaluated version > 0 is loaded from its broadcast first; one whose
  broadcast was pruned (or that an engine refused) fails (below); version 0 is evaluated only on
  engines that still serve it;
- eval episodes never enter the group table or the train sink (see `episodes.py`);
- eval never ends training: a version whose load or eval fails (an eval engine that disconnects, a
  broadcast pruned meanwhile) is retried `EVAL_ATTEMPTS` times with backoff, then skipped with one ERROR
  line and counted in `eval/failed_versions`; only cancellation passes through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prime_async.config.orchestrator import OrchestratorEvalConfig
from prime_async.engine_api import EngineClient
from prime_async.eval.episodes import Decode, EvalEnv, EvalResult, evaluate
from prime_async.weights.loaders.base import WeightLoader

logger = logging.getLogger(__name__)

EVAL_ATTEMPTS = 3
EVAL_BACKOFF_S = 1.0  # doubled after each failed attempt


def due_versions(cfg: OrchestratorEvalConfig, *, max_steps: int, start_version: int) -> list[int]:
    """The versions the run evaluates (module docstring), ascending."""
    due = set()
    if cfg.at_start:
        due.add(0)
    if cfg.interval is not None:
        due.update(range(cfg.interval, max_steps + 1, cfg.interval))
    if cfg.at_end:
        due.add(max_steps)
    return sorted(v for v in due if v >= start_version)


@dataclass(frozen=True)
class TrainingSide:
    """What the eval sees of the training run, all of it the weight watcher's: the version the training
    engines serve and the next batch step (`eval/lag_steps`); for the shared placement the update pin (an
    update waits while an eval holds it) and a load of the final version into the training engines."""

    served_version: Callable[[], int]
    progress: Callable[[], int] = lambda: 0
    pin: asyncio.Lock | None = None
    update_engines: Callable[[int], Awaitable[None]] | None = None


class InRunEval:
    """Runs the eval of each due version in the background (see the module docstring)."""

    def __init__(
        self,
        *,
        cfg: OrchestratorEvalConfig,
        envs: Sequence[EvalEnv],
        due: Sequence[int],
        on_result: Callable[[EvalResult], None],
        training: TrainingSide,
        loader: WeightLoader,
        engines: Sequence[EngineClient] = (),
        decode: Decode | None = None,
        poll_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ):
        if cfg.placement == "shared" and training.pin is None:
            raise ValueError("the shared eval placement needs the weight watcher's pin")
        if cfg.placement != "shared" and not engines:
            raise ValueError(f"the {cfg.placement} eval placement needs eval engines")
        self.cfg = cfg
        self.envs = list(envs)
        self.pending = sorted(due)
        self.on_result = on_result
        self.training = training
        self.engines = list(engines)
        self.loader = loader  # the run's broadcasts (eval runs on the filesystem transport only)
        self.decode = decode
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.skipped: list[int] = []
        self.failed: list[int] = []  # versions given up after EVAL_ATTEMPTS failures
        self._done = asyncio.Event()
        if not self.pending:
            self._done.set()

    async def run(self) -> None:
        """Evaluate due versions until none is left, then idle until cancelled (a supervised background
        task must not end while the run goes on)."""
        while self.pending:
            if self.cfg.placement == "shared":
                await self._shared_step()
            else:
                await self._dedicated_step()
        self._done.set()
        await asyncio.Event().wait()

    async def finish(self, timeout_s: float) -> None:
        """Wait until every due version was evaluated or skipped; a timeout is logged, not raised.

        Shared: the final version is loaded into the training engines once it is published (with
        `weights.update_interval > 1` the watcher alone might never load it)."""
        try:
            await asyncio.wait_for(self._finish(), timeout=timeout_s)
        except TimeoutError:
            logger.warning("eval of versions %s did not finish within %.0f s after the last batch; "
                           "giving up on them", self.pending, timeout_s)  # fmt: skip

    async def _finish(self) -> None:
        update_engines = self.training.update_engines
        if self.cfg.placement == "shared" and self.pending and update_engines is not None:
            final = self.pending[-1]
            while (self.loader.latest() or 0) < final:
                await asyncio.sleep(self.poll_interval_s)
            await update_engines(final)
        await self._done.wait()

    # -- placements ------------------------------------------------------------------------------------
    async def _shared_step(self) -> None:
        assert self.training.pin is not None
        if self.training.served_version() < self.pending[0]:
            await asyncio.sleep(self.poll_interval_s)
            return
        async with self.training.pin:  # weight updates wait until this eval is over
            version = self.training.served_version()
            self._take(version)
            await self._with_retries(version, lambda: self._evaluate(version))

    async def _dedicated_step(self) -> None:
        latest = self.loader.latest()
        available = [v for v in self.pending if v == 0 or (latest is not None and v <= latest)]
        if not available:
            await asyncio.sleep(self.poll_interval_s)
            return
        version = available[-1]
        self._take(version)

        async def load_and_evaluate() -> None:
            if await self._load(version):
                await self._evaluate(version)
            else:
                self.skipped.append(version)

        await self._with_retries(version, load_and_evaluate)

    async def _with_retries(self, version: int, attempt: Callable[[], Awaitable[None]]) -> None:
        """Run `attempt` until it succeeds, at most EVAL_ATTEMPTS times; then skip `version` (module
        docstring: eval never ends training)."""
        delay = EVAL_BACKOFF_S
        for number in range(1, EVAL_ATTEMPTS + 1):
            try:
                await attempt()
                return
            except Exception as e:  # tolerated: eval is not worth a training run (CancelledError passes)
                error = f"{type(e).__name__}: {e}"
                if number == EVAL_ATTEMPTS:
                    break
                logger.warning("eval of version %d failed (attempt %d of %d, %s): retry in %.0f s",
                               version, number, EVAL_ATTEMPTS, error, delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay *= 2
        self.failed.append(version)
        logger.error("eval of version %d failed %d times (last: %s): skipped; training goes on",
                     version, EVAL_ATTEMPTS, error)  # fmt: skip

    # -- helpers ---------------------------------------------------------------------------------------
    def _take(self, version: int) -> None:
        """Remove every pending version <= `version`; the ones below it are skipped."""
        passed = [v for v in self.pending if v <= version]
        self.pending = [v for v in self.pending if v > version]
        self.skipped.extend(v for v in passed if v != version)

    async def _load(self, version: int) -> bool:
        """Make every eval engine serve `version`; False (warned) when v0 is asked of engines that serve
        another version. A version > 0 is always loaded from its broadcast (a label alone could name
        weights of a history rolled back since); errors propagate to `_with_retries`."""
        if version == 0:
            versions = await asyncio.gather(*(e.weight_version() for e in self.engines))
            if set(versions) == {0}:
                return True
            logger.warning("eval engines serve versions %s, not the initial model: eval of v0 skipped",
                           sorted(set(versions)))  # fmt: skip
            return False
        await self.loader.load(self.engines, version, flush_cache=True)  # a failure (pruned, gone) is retried
        return True

    async def _evaluate(self, version: int) -> None:
        start = self.clock()
        result = await evaluate(
            self.envs, version=version, max_concurrent_episodes=self.cfg.max_concurrent_episodes,
            decode=self.decode, clock=self.clock,
        )  # fmt: skip
        result.metrics["eval/time"] = self.clock() - start
        result.metrics["eval/lag_steps"] = float(max(self.training.progress() - version, 0))
        result.metrics["eval/skipped_versions"] = float(len(self.skipped))
        result.metrics["eval/failed_versions"] = float(len(self.failed))
        for line in result.summary([env.name for env in self.envs]):
            logger.info(line)
        self.on_result(result)
