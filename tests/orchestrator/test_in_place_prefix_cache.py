"""`in_place` updates and multi-turn episodes: no request reuses prefix KV computed under older weights.

The fake engine models what SGLang does (measured on SGLang 0.5.23): a radix prefix cache keyed by
tokens only, not by weights; `update_weights_from_disk(flush_cache=False)` keeps it; `/flush_cache` is
refused while requests run; `in_place` pause freezes running requests, which resume with their KV. The
real Gateway and WeightWatcher run against it.

Scenario: episodes A and B start turn 1; B's turn 1 ends and its KV is cached at v0; the update to v1
starts while A's turn 1 is still running; B sends turn 2 (its prompt extends turn 1's tokens). Before
the fix, B's turn 2 went straight to the engine and reused the v0 prefix under v1 weights.
"""

from __future__ import annotations

import asyncio

from prime_async.engine_api import GenerateResult
from prime_async.inference.client import EngineError
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.groups import GroupTable
from prime_async.rollouts.gateway import Gateway
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.watcher import WeightWatcher
from prime_async.weights.watcher_peers import WatcherSettings


class PrefixCacheEngine:
    """Hand-written fake of an SGLang engine's prefix cache and pause/update/flush rules."""

    base_url = "fake://engine"

    def __init__(self, durations: dict[int, float]) -> None:
        self.version = 0
        self.cache: dict[tuple[int, ...], int] = {}  # token prefix -> version its KV was computed under
        self.durations = durations  # first prompt token -> seconds of generation
        self.running = 0
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.stale_reuse: list[tuple[int, ...]] = []
        self.log: list[str] = []

    async def generate(self, input_ids, sampling_params, rid=None) -> GenerateResult:
        prompt = tuple(input_ids)
        hit = max((p for p in self.cache if prompt[: len(p)] == p), key=len, default=None)
        if hit is not None and self.cache[hit] != self.version:
            self.stale_reuse.append(prompt)
        self.running += 1
        self.log.append(f"start {rid} v{self.version}")
        try:
            await asyncio.sleep(self.durations[prompt[0]])
            await self.unpaused.wait()
            output = [7, 8]
            self.cache[prompt + tuple(output)] = self.version
        finally:
            self.running -= 1
        self.log.append(f"end {rid}")
        return GenerateResult(
            rid or "", output, [-0.5, -0.5], [self.version] * 2, "stop", len(prompt), self.version
        )

    async def pause_generation(self, mode: str) -> None:
        self.unpaused.clear()

    async def continue_generation(self) -> None:
        self.unpaused.set()

    async def update_weights_from_disk(self, path, version, *, flush_cache, abort_all_requests=False) -> None:
        self.version = version
        if flush_cache:
            await self.flush_cache()

    async def flush_cache(self) -> None:
        if self.running:
            raise EngineError(400, "/flush_cache", "requests are running")
        self.cache.clear()
        self.log.append("flush")

    async def abort_request(self, rid=None, *, abort_all=False) -> None:
        pass


def _body(key: str, tokens: list[int]) -> dict:
    return {"model": key, "token_ids": tokens, "sampling_params": {"max_tokens": 2}}


def test_next_turn_after_in_place_update_never_reuses_old_prefix_kv() -> None:
    async def main() -> PrefixCacheEngine:
        engine = PrefixCacheEngine(durations={1: 0.4, 2: 0.02})
        gateway = Gateway(engines=[engine], seq_len=64)
        groups = GroupTable(group_size=1, batch_groups=4, max_off_policy_steps=1,
                            data=DataSource(num_examples=1), retry_unused=False,
                            max_dropped_groups_per_step=1)  # fmt: skip
        admission = AdmissionController(groups=groups, max_inflight_groups=4, max_buffered_groups=4,
                                        granularity="group")  # fmt: skip
        watcher = WeightWatcher(
            engines=[engine],
            loader=FilesystemLoader(type("B", (), {"path": staticmethod(lambda v: f"/b/step_{v}")})()),
            admission=admission, groups=groups,
            settings=WatcherSettings("in_place", 1, 1.0), request_gate=gateway.gate,
        )  # fmt: skip
        a = gateway.open_session(engine_key="0")
        b = gateway.open_session(engine_key="0")
        turn_a = asyncio.create_task(gateway.generate(_body(a.key, [1, 3])))
        await gateway.generate(_body(b.key, [2, 3]))  # B's turn 1: cached at v0
        update = asyncio.create_task(watcher.update(1))
        await asyncio.sleep(0.05)  # the update is under way, A's turn 1 still runs
        turn_b2 = await gateway.generate(_body(b.key, [2, 3, 7, 8, 5]))  # B's next turn
        await asyncio.gather(turn_a, update)
        assert turn_b2["choices"][0]["token_ids"] == [7, 8]
        assert gateway.gate.num_held == 1 and gateway.gate.is_open
        return engine

    engine = asyncio.run(main())
    assert engine.stale_reuse == [], f"requests reused prefix KV of older weights: {engine.stale_reuse}"
    # A's turn 1 finished in place, then the cache was flushed, then B's turn 2 ran on v1
    flush = engine.log.index("flush")
    assert engine.log.index(next(e for e in engine.log if e.startswith("end ep-0"))) < flush
    assert engine.log[flush + 1].startswith("start ep-1") and engine.log[flush + 1].endswith("v1")


def test_shared_eval_gateways_pass_the_watchers_one_gate() -> None:
    """Regression (issue: shared eval x in_place): wiring the shared-placement eval's gateways used to
    replace the watcher's gate with the eval gateway's, so an update held only eval requests; a training
    turn then started between the load and the flush (old prefix KV) and the flush met it (HTTP 400).
    Now the gate is built first and given to every gateway and to the watcher in their constructors."""
    from types import SimpleNamespace

    from prime_async.weights.request_gate import RequestGate

    async def main() -> PrefixCacheEngine:
        engine = PrefixCacheEngine(durations={1: 0.4, 2: 0.02})
        gate = RequestGate()
        train = SimpleNamespace(gateway=Gateway(engines=[engine], seq_len=64, gate=gate))
        evals = SimpleNamespace(gateway=Gateway(engines=[engine], seq_len=64, gate=gate))
        groups = GroupTable(group_size=1, batch_groups=4, max_off_policy_steps=1,
                            data=DataSource(num_examples=1), retry_unused=False,
                            max_dropped_groups_per_step=1)  # fmt: skip
        admission = AdmissionController(groups=groups, max_inflight_groups=4, max_buffered_groups=4,
                                        granularity="group")  # fmt: skip
        watcher = WeightWatcher(
            engines=[engine],
            loader=FilesystemLoader(type("B", (), {"path": staticmethod(lambda v: f"/b/step_{v}")})()),
            admission=admission, groups=groups, settings=WatcherSettings("in_place", 1, 1.0),
            request_gate=gate,
        )  # fmt: skip
        assert train.gateway.gate is evals.gateway.gate is watcher.request_gate
        e = evals.gateway.open_session(engine_key="0")
        t = train.gateway.open_session(engine_key="0")
        eval_turn = asyncio.create_task(evals.gateway.generate(_body(e.key, [1, 3])))
        await train.gateway.generate(_body(t.key, [2, 3]))  # training turn 1: cached at v0
        update = asyncio.create_task(watcher.update(1))
        await asyncio.sleep(0.05)  # the update is under way, the eval request still runs
        await train.gateway.generate(_body(t.key, [2, 3, 7, 8, 5]))  # the training episode's next turn
        await asyncio.gather(eval_turn, update)  # before the fix: EngineError 400 from the flush
        assert watcher.request_gate.num_held == 1 and watcher.request_gate.is_open
        return engine

    engine = asyncio.run(main())
    assert engine.stale_reuse == [], f"requests reused prefix KV of older weights: {engine.stale_reuse}"
