"""In-process simulation of the RL loop around the orchestrator, for tests and benchmarks.

    VirtualClockLoop: an asyncio loop whose clock jumps to the next timer when nothing is ready, so a
        run of hours of simulated generation takes milliseconds and is deterministic (no real sleeps);
    SimulatedEngine: `EngineClient` with heavy-tailed (Pareto) latency, per-token versions, pause modes,
        and SGLang's refusals (flush_cache=True with in_place-paused requests fails);
    SimulatedRolloutSource: `RolloutSource` running one generate call per episode on a sticky engine;
    InMemoryBroadcasts + FakeTrainer: consume batches, publish version n+1 after a simulated train time;
    with `cfg.eval` the real in-run eval runs on simulated sources (shared: the training engines;
    dedicated/external: engines of its own that load each version).

Used by the tests, `scripts/bench_orchestrator.py` and `uv run plan` (which feeds it measured timings);
never by a run. `run_simulation` wires the real components exactly as `orchestrator/main.py` does
(build_components + run_loop), only engines, source, trainer and clock are simulated.
"""

from __future__ import annotations

import asyncio
import random
import selectors
import zlib
from dataclasses import dataclass, field
from typing import Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import GenerateResult, SamplingParams
from prime_async.eval.episodes import EvalResult
from prime_async.eval.in_run import InRunEval, TrainingSide, due_versions
from prime_async.eval.setup import eval_envs
from prime_async.orchestrator.components import ComponentInputs, Components, build_components
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode, NoGateway
from prime_async.transport.types import TrainBatch
from prime_async.types import EnginePauseMode
from prime_async.weights.loaders.filesystem import FilesystemLoader


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None):  # type: ignore[override]
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("virtual clock: deadlock (no timer scheduled and nothing ready)")
        assert self.loop is not None
        self.loop.virtual_now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """Event loop with simulated time: `time()` only advances when every task waits on a timer."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.virtual_now = 0.0

    def time(self) -> float:
        return self.virtual_now


def run_virtual(coro: Any) -> Any:
    """Run `coro` to completion on a fresh VirtualClockLoop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@dataclass
class SimParams:
    """Knobs of the simulated world (times in simulated seconds)."""

    num_engines: int = 2
    num_examples: int = 64
    latency_s: float = 1.0  # scale of the Pareto latency of one episode
    pareto_alpha: float = 1.5  # heavier tail when smaller
    max_latency_s: float = 60.0
    num_chunks: int = 4  # decode chunks per episode (version boundaries can fall between them)
    prompt_len: int = 8
    max_new_tokens: int = 16
    train_time_s: float = 1.0
    update_time_s: float = 0.05
    error_rate: float = 0.0
    seed: int = 0
    # measured episode seconds by group: a group draws one recorded group's latencies (its episodes in
    # order) instead of the Pareto; a stall that slowed a whole group stays one group's worth
    latency_groups: tuple[tuple[float, ...], ...] = ()
    engine_slots: int | None = None  # requests one engine runs at once (more queue); None = unbounded
    cut_time_s: float = 0.0  # orchestrator time per batch cut (build, checkpoint, send) before the trainer
    write_time_s: float = 0.0  # background weight write after each step (0: published when trained)
    saturation: float | None = None  # running requests past which an engine is throughput-bound (slows down)
    # None: an episode's length is drawn independently of its latency (uniform 1..max_new_tokens); a rate:
    # its length is latency * tokens_per_s (clamped to 1..max_new_tokens), the slow episodes the long ones
    tokens_per_s: float | None = None
    # The fake trainer wakes the watcher on publish; polling is only a fallback (each poll costs CPU).
    watcher_poll_s: float = 60.0


class SimulatedEngine:
    """An engine with simulated time. Pausing stops decoding at chunk boundaries until continue."""

    def __init__(self, *, index: int, params: SimParams, rng: random.Random):
        self.base_url = f"sim://engine{index}"
        self.params = params
        self.rng = rng
        self.version = 0
        self.paused: EnginePauseMode | None = None
        self._resume = asyncio.Event()
        self._resume.set()
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.calls: list[tuple[str, Any]] = []
        self._slots = asyncio.Semaphore(params.engine_slots) if params.engine_slots else None

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None,
        latency_s: float | None = None, progress: list[int] | None = None,
    ):  # fmt: skip
        """`latency_s`: this request's unloaded latency (None: drawn from the Pareto); `progress`: gets the
        tokens of each decoded chunk as it completes (what a cancelled request had sampled)."""
        if self._slots is None:
            return await self._generate(input_ids, sampling_params, rid, latency_s, progress)
        async with self._slots:
            return await self._generate(input_ids, sampling_params, rid, latency_s, progress)

    def _latency(self) -> float:
        p = self.params
        return min(p.latency_s * self.rng.paretovariate(p.pareto_alpha), p.max_latency_s)

    def _slowdown(self) -> float:
        """Past `saturation` running requests the engine shares its throughput: each one slows down."""
        sat = self.params.saturation
        return max(1.0, self.running / sat) if sat else 1.0

    async def _generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None, latency_s: float | None,
        progress: list[int] | None = None,
    ):  # fmt: skip
        p = self.params
        latency = self._latency() if latency_s is None else latency_s
        limit = min(p.max_new_tokens, sampling_params.get("max_new_tokens", 1 << 30))
        if p.tokens_per_s is None:
            n_tokens = self.rng.randint(1, limit)
        else:
            n_tokens = min(max(1, round(latency * p.tokens_per_s)), limit)
        self.running += 1
        self._idle.clear()
        try:
            versions: list[int] = []
            for chunk in range(p.num_chunks):
                await self._resume.wait()
                version = self.version
                await asyncio.sleep(latency / p.num_chunks * self._slowdown())
                lo, hi = chunk * n_tokens // p.num_chunks, (chunk + 1) * n_tokens // p.num_chunks
                versions.extend([version] * (hi - lo))
                if progress is not None:
                    progress.append(hi - lo)
        finally:
            self.running -= 1
            if self.running == 0:
                self._idle.set()
        out = [(input_ids[0] + i) % 1000 for i in range(n_tokens)]
        return GenerateResult(
            rid=rid or "", output_ids=out, output_logprobs=[-1.0] * n_tokens, token_versions=versions,
            finish_type="length", prompt_tokens=len(input_ids), weight_version=self.version,
        )  # fmt: skip

    async def pause_generation(self, mode: EnginePauseMode) -> None:
        self.calls.append(("pause", mode))
        self.paused = mode
        self._resume.clear()

    async def continue_generation(self) -> None:
        self.calls.append(("continue", None))
        self.paused = None
        self._resume.set()

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, *, flush_cache: bool, abort_all_requests: bool = False
    ) -> None:
        self.calls.append(("update", (model_path, weight_version, flush_cache)))
        if flush_cache and self.paused == "in_place" and self.running:
            raise RuntimeError("400: flush_cache with in_place-paused requests (SGLang refuses)")
        if self.paused is None:
            await self._idle.wait()  # SGLang: not paused, the update waits for in-flight requests
        await asyncio.sleep(self.params.update_time_s)
        self.version = weight_version

    async def flush_cache(self) -> None:
        self.calls.append(("flush", self.running))
        if self.running:
            raise RuntimeError("flush_cache refused: requests are running")

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self.calls.append(("abort", rid))

    async def weight_version(self) -> int:
        return self.version

    async def health(self) -> bool:
        return True

    async def server_info(self) -> dict[str, Any]:
        return {}  # no busy/uptime counters: left out of engine/busy_fraction


class SimulatedRolloutSource(NoGateway):
    """One `generate` per episode on the engine chosen by `engine_key`; reward from a seeded RNG. It keeps
    what a cancelled episode had sampled; it records no calls (`replay` is ignored)."""

    def __init__(
        self, *, engines: list[SimulatedEngine], params: SimParams, rng: random.Random,
        num_examples: int | None = None,
    ):  # fmt: skip
        self.engines = engines
        self.params = params
        self.rng = rng
        self.started: list[int] = []
        self._num_examples = params.num_examples if num_examples is None else num_examples
        self._group_latencies: dict[int, list[float]] = {}  # example -> latencies left of its group
        self.cancelled_lengths: dict[str, list[int]] = {}  # engine key -> tokens sampled when cancelled

    @property
    def num_examples(self) -> int:
        return self._num_examples

    def _recorded_latency(self, example_id: int) -> float | None:
        """The next latency of this example's group, drawn from `params.latency_groups` (None: none)."""
        if not self.params.latency_groups:
            return None
        left = self._group_latencies.get(example_id)
        if not left:
            left = self._group_latencies[example_id] = list(self.rng.choice(self.params.latency_groups))
        return left.pop(0)

    def take_cancelled_lengths(self, engine_key: str) -> list[int]:
        return self.cancelled_lengths.pop(engine_key, [])

    async def run_episode(
        self, *, example_id: int, engine_key: str, sampling: SamplingParams, replay: Any = None
    ) -> Episode:
        self.started.append(example_id)
        engine = self.engines[zlib.crc32(engine_key.encode()) % len(self.engines)]
        prompt = [example_id % 997 + 1] * self.params.prompt_len
        progress: list[int] = []
        try:
            res = await engine.generate(
                prompt, sampling.to_sglang(), latency_s=self._recorded_latency(example_id), progress=progress
            )
        except asyncio.CancelledError:
            self.cancelled_lengths[engine_key] = [sum(progress)]
            raise
        n_prompt, n_out = len(prompt), len(res.output_ids)
        ep = Episode(
            example_id=example_id,
            token_ids=prompt + res.output_ids,
            loss_mask=[False] * n_prompt + [True] * n_out,
            sampler_logprobs=[0.0] * n_prompt + res.output_logprobs,
            token_versions=[-1] * n_prompt + res.token_versions,
            reward=float(self.rng.random() < 0.5),
        )
        if self.rng.random() < self.params.error_rate:
            ep.status, ep.error = "error", "simulated environment fault"
        return ep


class InMemoryBroadcasts:
    """Versions published by the FakeTrainer; STABLE is implicit in `publish`."""

    def __init__(self) -> None:
        self.latest: int | None = None

    def latest_stable(self) -> int | None:
        return self.latest

    def path(self, version: int) -> str:
        return f"sim://broadcasts/step_{version}"


@dataclass
class SimulationResult:
    trained: dict[int, list[Group]] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    batches: dict[int, TrainBatch] = field(default_factory=dict)
    cancel_checks: int = 0
    comps: Components | None = None
    engines: list[SimulatedEngine] = field(default_factory=list)
    source: SimulatedRolloutSource | None = None
    elapsed_s: float = 0.0
    evals: list[EvalResult] = field(default_factory=list)
    eval_engines: list[SimulatedEngine] = field(default_factory=list)


class FakeTrainer:
    """Trains batch n for `train_time_s` (simulated), then publishes version n+1 and wakes the watcher.

    With `write_time_s` the version is written in the background (the real trainer's weight writer): it
    becomes visible `write_time_s` later, one write in flight at a time (the next publish waits for it)."""

    def __init__(
        self, *, broadcasts: InMemoryBroadcasts, train_time_s: float, max_off_policy_steps: int,
        write_time_s: float = 0.0,
    ):  # fmt: skip
        self.broadcasts = broadcasts
        self.train_time_s = train_time_s
        self.write_time_s = write_time_s
        self.k = max_off_policy_steps
        self.queue: asyncio.Queue[TrainBatch] = asyncio.Queue()
        self.on_publish: list[Any] = []

    async def send(self, batch: TrainBatch) -> None:
        self.queue.put_nowait(batch)

    async def run(self, start_step: int, max_steps: int) -> None:
        writing: asyncio.Task | None = None
        for step in range(start_step, max_steps):
            batch = await self.queue.get()
            assert batch.step == step, f"trainer expected batch {step}, got {batch.step}"
            assert step - batch.min_dispatch_version <= self.k, "trainer received a group staler than K"
            await asyncio.sleep(self.train_time_s)
            if not self.write_time_s:
                self._publish(step + 1)
                continue
            if writing is not None:
                await writing
            writing = asyncio.create_task(self._write(step + 1))
        if writing is not None:
            await writing

    async def _write(self, version: int) -> None:
        await asyncio.sleep(self.write_time_s)
        self._publish(version)

    def _publish(self, version: int) -> None:
        self.broadcasts.latest = version
        for callback in self.on_publish:
            callback()


def _instrument_caps(comps: Components) -> None:
    """Assert both caps and the K rule right after every dispatch (test instrumentation, not a mock)."""
    adm, groups, original = comps.admission, comps.groups, comps.groups.dispatch

    def checked(group: Group, task: asyncio.Task | None = None) -> None:
        original(group, task)
        buffered = groups.num_inflight_groups + groups.num_buffered_groups
        assert buffered <= adm.max_buffered_groups, f"buffer cap exceeded: {buffered}"
        if adm.granularity == "group":
            assert groups.num_inflight_groups <= adm.max_inflight_groups, "in-flight cap exceeded"
        else:
            cap = adm.max_inflight_groups * groups.group_size
            assert groups.running_episodes <= cap, "in-flight cap exceeded"
        landing = groups.next_batch_step + (groups.num_inflight_groups + groups.num_buffered_groups - 1) // (
            groups.batch_groups
        )
        assert landing <= groups.deadline(group), "K rule violated: the group lands in a batch past its K"

    groups.dispatch = checked  # type: ignore[method-assign]


def _instrument_cancel(comps: Components, result: SimulationResult) -> None:
    """Check that a cancel hits exactly the in-flight groups that can no longer ship."""
    groups, original = comps.groups, comps.groups.cancel_unshippable

    def checked() -> list[int]:
        k, nxt = groups.max_off_policy_steps, groups.next_batch_step
        before = {g.group_id: g.dispatch_version for g in groups.inflight()}
        cancelled = original()
        expected = {gid for gid, d in before.items() if nxt - d > k and not groups.token_rule}
        assert set(cancelled) == expected, f"cancelled {sorted(cancelled)} != unshippable {sorted(expected)}"
        assert {g.group_id for g in groups.inflight()} == set(before) - expected
        result.cancel_checks += 1
        return cancelled

    groups.cancel_unshippable = checked  # type: ignore[method-assign]


async def run_simulation(
    cfg: OrchestratorConfig,
    params: SimParams,
    *,
    broadcasts: InMemoryBroadcasts | None = None,
    instrument: bool = True,
) -> SimulationResult:
    """Run the real orchestrator components against simulated engines and a fake trainer."""
    loop = asyncio.get_running_loop()
    rng = random.Random(params.seed)
    engines = [SimulatedEngine(index=i, params=params, rng=rng) for i in range(params.num_engines)]
    # one source per training env; an env's `args.num_examples` overrides `params.num_examples`
    sources = {
        env.label: SimulatedRolloutSource(
            engines=engines, params=params, rng=rng, num_examples=env.args.get("num_examples")
        )
        for env in cfg.envs
    }
    source = next(iter(sources.values()))
    broadcasts = broadcasts or InMemoryBroadcasts()
    inputs = ComponentInputs(
        sources, engines, FilesystemLoader(broadcasts), served_version=0, clock=loop.time
    )
    comps = build_components(cfg, inputs)
    comps.watcher.poll_interval_s = params.watcher_poll_s
    result = SimulationResult(comps=comps, engines=engines, source=source)
    if instrument:
        _instrument_caps(comps)
        _instrument_cancel(comps, result)
    trainer = FakeTrainer(
        broadcasts=broadcasts,
        train_time_s=params.train_time_s,
        max_off_policy_steps=cfg.max_off_policy_steps,
        write_time_s=params.write_time_s,
    )
    trainer.on_publish.append(comps.watcher.wake)

    def on_step(step: int, groups: list[Group]) -> None:
        result.trained[step] = groups

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        result.metrics[step] = metrics

    async def send(batch: TrainBatch) -> None:
        result.batches[batch.step] = batch
        if params.cut_time_s:
            await asyncio.sleep(params.cut_time_s)
        await trainer.send(batch)

    evaluator = _evaluator(cfg, comps, params, rng, broadcasts, result) if cfg.eval.enabled else None
    start = loop.time()
    trainer_task = asyncio.create_task(trainer.run(comps.start_step, cfg.max_steps))
    try:
        await run_loop(cfg, comps, send_batch=send, log_metrics=log_metrics, on_step=on_step, clock=loop.time,
                       evaluator=evaluator)  # fmt: skip
        await trainer_task
    finally:
        trainer_task.cancel()
    result.elapsed_s = loop.time() - start
    return result


def _evaluator(
    cfg: OrchestratorConfig, comps: Components, params: SimParams, rng: random.Random,
    broadcasts: InMemoryBroadcasts, result: SimulationResult,
) -> InRunEval:  # fmt: skip
    """The real in-run eval over simulated sources (one per eval env)."""
    engines = comps.watcher.engines
    if cfg.eval.placement != "shared":
        count = len(cfg.eval.base_urls)
        engines = [SimulatedEngine(index=100 + i, params=params, rng=rng) for i in range(count)]
        result.eval_engines = engines
    sources = [
        SimulatedRolloutSource(engines=engines, params=params, rng=rng, num_examples=env.num_examples)
        for env in cfg.eval.envs
    ]
    envs = eval_envs(cfg.eval.envs, sources, base_sampling=cfg.sampling, eval_sampling=cfg.eval.sampling)
    return InRunEval(
        cfg=cfg.eval, envs=envs, on_result=result.evals.append,
        due=due_versions(cfg.eval, max_steps=cfg.max_steps, start_version=comps.admission.served_version),
        training=TrainingSide(
            served_version=lambda: comps.admission.served_version,
            progress=lambda: comps.groups.next_batch_step,
            pin=comps.watcher.pin,
            update_engines=comps.watcher.update_to,
        ),
        loader=FilesystemLoader(broadcasts), engines=engines if cfg.eval.placement != "shared" else (),
        clock=asyncio.get_running_loop().time,
    )  # fmt: skip
