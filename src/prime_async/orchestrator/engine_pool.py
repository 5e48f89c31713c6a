"""The elastic engine pool: engines join and leave a running orchestrator (`docs/elastic.md`).

    rl-engines add|remove ──► output_dir/engines/requests/<id>.json (`engine_requests.py`)
        ──► EnginePool.run() (reads it every POLL_S) ──► add / remove ──► results/<id>.json, live.json

The run's engines are one list object (`LifetimeIO.engines`) shared by the gateways (routing), the weight
watcher (pause, load, resume, outages, the in_place flush), the weight probe, the engine-load metric and
the planned stop; the pool changes that list in place, so every one of them sees the live count at once.

Join (`add`): the engine answers /health, is this run's (`check_engines_belong_to_run`: run id, else the
model path), then, holding the watcher's pin (no weight update or shared-placement eval runs meanwhile),
it is loaded with the served version (unless it serves it already) and its reported version is checked;
only then is it appended to the list, so no request reaches it before it serves the run's weights. A
failure at any point (it died, refused, timed out) drops it with one log line; the run goes on.

Leave (`remove`): holding the pin, admission is held and every group in flight finishes (the `drain`
protocol of a weight update, for every pause mode), then the engine is taken out of the list and
admission released. A gateway session keeps the index of its engine, so the list only shrinks while no
episode is in flight; nothing is cancelled, so nothing is lost or trained twice, and the ledger and the
K rule are untouched.

Restart (`restore`): every change is saved (`engines/membership.json`, with the run id); a later lifetime
of the same run (the orchestrator restarted, or resumed) makes the same changes at its start, each one
checked as above; another run's file is ignored.

Invariants: the list changes only under the pin; a joined engine serves `served_version` when it is
appended; the last engine cannot leave; `max_inflight_groups` is the start's per-engine share times the
live count (at least 1); only the filesystem weight transport with full weights joins engines (the
distributed transport's process group has a fixed world size, the shared one maps one engine's memory,
LoRA engines name adapters per version). Every wait has the request's deadline (`timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineClient
from prime_async.orchestrator import engine_requests as requests
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.components import Components
from prime_async.orchestrator.engine_requests import EngineRequest, EngineResult
from prime_async.orchestrator.groups import GroupTable
from prime_async.rollouts.engine_checks import check_engines_belong_to_run, wait_for_engines
from prime_async.weights.watcher import WeightWatcher

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often the requests directory is read (a glob of one small directory)


class EnginePool:
    """Adds and removes engines of the run's one engine list (module docstring)."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        engines: list[EngineClient],
        *,
        watcher: WeightWatcher,
        admission: AdmissionController,
        groups: GroupTable,
        make_client: Callable[[str, str | None], EngineClient],
    ):
        self.cfg = cfg
        self.engines = engines
        self.watcher = watcher
        self.admission = admission
        self.groups = groups
        self.make_client = make_client
        self.per_engine = admission.max_inflight_groups / max(1, len(engines))
        self.output_dir = Path(cfg.output_dir)
        self.added: dict[str, str | None] = {}  # URL -> API key of the engines joined (this run)
        self.removed: list[str] = []  # configured engines that left (this run)

    @property
    def urls(self) -> list[str]:
        return [e.base_url for e in self.engines]

    def refusal(self) -> str | None:
        """Why this run cannot change its engines (one line), or None."""
        if self.cfg.weights.transport != "filesystem":
            return f"weights.transport = {self.cfg.weights.transport!r}: only 'filesystem' runs add engines"
        if self.cfg.inference.lora is not None:
            return "a LoRA run cannot add engines yet (its engines name an adapter per version)"
        return None

    async def run(self) -> None:
        """Make an earlier lifetime's changes again, then answer every request in the requests directory,
        oldest first, until cancelled."""
        requests.write_live(self.output_dir, self.urls, self.admission.served_version)
        await self.restore()
        requests.write_live(self.output_dir, self.urls, self.admission.served_version)
        while True:
            try:
                for rid, req in requests.pending(self.output_dir):
                    result = await self.handle(req)
                    requests.answer(self.output_dir, rid, result)
                    requests.write_live(self.output_dir, self.urls, self.admission.served_version)
            except OSError as e:  # the control files are unreadable: said once per poll, the run goes on
                logger.warning("engine pool: %s: %s", type(e).__name__, e)
            await asyncio.sleep(POLL_S)

    async def restore(self) -> None:
        """An orchestrator restart of this run: the engines an earlier lifetime added join again (checked
        and loaded as any join), then the configured ones it removed leave again; a failure is one line."""
        added, removed = requests.load_membership(self.output_dir, self.cfg.inference.run_id)
        if not added and not removed:
            return
        logger.info("engine pool: an earlier lifetime added %d and removed %d engine(s): again", len(added),
                    len(removed))  # fmt: skip
        for url, key in added.items():
            await self.handle(EngineRequest("add", url, key))
        for url in removed:
            if url in self.urls:
                await self.handle(EngineRequest("remove", url))

    async def handle(self, req: EngineRequest | ValueError) -> EngineResult:
        """One request's result; every failure is one log line and a refused result, never an exception."""
        try:
            if isinstance(req, ValueError):
                raise req
            message = await (self.add(req) if req.op == "add" else self.remove(req))
        except Exception as e:  # the run goes on whatever a joining engine does
            what = "request" if isinstance(req, ValueError) else f"{req.op} {req.url}"
            reason = "no answer within the deadline" if isinstance(e, TimeoutError) else str(e) or repr(e)
            logger.warning("engine pool: %s refused: %s", what, reason)
            return EngineResult(False, f"{what} refused: {reason}", tuple(self.urls))
        logger.info("engine pool: %s (%d engine(s) now)", message, len(self.engines))
        self._remember(req)
        return EngineResult(True, message, tuple(self.urls))

    def _remember(self, req: EngineRequest) -> None:
        """Save the membership change (`engine_requests.save_membership`) for a restarted orchestrator."""
        if req.op == "add":
            self.added[req.url] = req.api_key
            self.removed = [url for url in self.removed if url != req.url]
        elif req.url in self.added:
            del self.added[req.url]
        else:  # a configured engine left
            self.removed.append(req.url)
        if self.cfg.inference.run_id is not None:
            requests.save_membership(self.output_dir, self.cfg.inference.run_id, self.added, self.removed)

    async def add(self, req: EngineRequest) -> str:
        """Join the engine at `req.url` (module docstring); raises (one line) when it cannot join."""
        if (refused := self.refusal()) is not None:
            raise ValueError(refused)
        if req.url in self.urls:
            raise ValueError(f"{req.url} is already one of the run's engines")
        client = self.make_client(req.url, req.api_key or self.cfg.inference.api_key)
        try:
            version = await asyncio.wait_for(self._join(client, req.timeout_s), timeout=req.timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await client.aclose()
            raise
        return f"{req.url} joined at weight version {version}"

    async def _join(self, client: EngineClient, timeout_s: float) -> int:
        await wait_for_engines([client], timeout_s=timeout_s / 2)  # the rest: the checks and the load
        broadcasts = self.output_dir / "broadcasts"
        await check_engines_belong_to_run(
            [client], self.cfg.inference.run_id, model_path=str(self.cfg.model.path), broadcasts=broadcasts
        )
        async with self.watcher.pin:  # no update runs while it loads: it joins at the served version
            served = self.admission.served_version
            if await client.weight_version() != served:
                await self._load(client, served)
            reported = await client.weight_version()
            if reported != served:
                raise RuntimeError(f"it serves weight version {reported} after loading v{served}")
            self.engines.append(client)
            self._resize()
        return served

    async def _load(self, client: EngineClient, version: int) -> None:
        """Load `version` into a joining engine: v0 is the run's model itself (no broadcast holds it; a run
        rolled back to step 0 serves it again while the joiner may still serve a later version)."""
        if version == 0:
            await client.update_weights_from_disk(str(self.cfg.model.path), 0, flush_cache=True)
        else:
            await self.watcher.loader.load([client], version, flush_cache=True)

    async def remove(self, req: EngineRequest) -> str:
        """Drain, then drop the engine at `req.url` (module docstring); raises (one line) when it cannot."""
        client = next((e for e in self.engines if e.base_url == req.url), None)
        if client is None:
            raise ValueError(f"{req.url} is not one of the run's engines ({', '.join(self.urls)})")
        if len(self.engines) == 1:
            raise ValueError(f"{req.url} is the run's last engine")
        await asyncio.wait_for(self._leave(client), timeout=req.timeout_s)
        with contextlib.suppress(Exception):
            await client.aclose()
        return f"{req.url} left after its groups finished"

    async def _leave(self, client: EngineClient) -> None:
        async with self.watcher.pin:
            self.admission.hold()
            try:
                await self.groups.wait_idle()  # no episode in flight: no session holds an engine index
                self.engines.remove(client)
                self._resize()
            finally:
                self.admission.release()

    def _resize(self) -> None:
        """Admission's in-flight cap follows the live engine count."""
        self.admission.max_inflight_groups = max(1, math.ceil(self.per_engine * len(self.engines)))
        self.admission.notify()


async def start_engine_pool(
    cfg: OrchestratorConfig, engines: list[EngineClient], comps: Components, stack: contextlib.AsyncExitStack
) -> EnginePool:
    """The pool over the run's engine list, answering requests in a task `stack` cancels."""
    from prime_async.inference.client import engine_clients

    def make_client(url: str, api_key: str | None) -> EngineClient:
        return engine_clients([url], api_key, lora=False, routed_experts=cfg.inference.router_replay)[0]

    pool = EnginePool(
        cfg, engines, watcher=comps.watcher, admission=comps.admission, groups=comps.groups,
        make_client=make_client,
    )  # fmt: skip
    task = asyncio.create_task(pool.run(), name="engine-pool")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, timeout=5.0)
        requests.clear_live(pool.output_dir)  # `rl-engines` now says no orchestrator runs there

    stack.push_async_callback(stop)
    return pool
