"""The orchestrator process: wires the components and runs the main loop. No component imports this.

    EnvMix (schedule, DataSource per env) ─► Dispatcher ─(Admission)─► RolloutSource of the group's env
                                                        (verifiers env ─► gateway ─► engines)
                      │  finished groups                                        ▲
                      ▼                                                         │ pause / update / resume
                  TrainSink ── get_batch(n): sweep vs K, take oldest ─► build_train_batch ─► BatchSender
                                                                                │ (ZMQ, pull by trainer)
    trainer ── broadcasts/step_N/STABLE ──► WeightWatcher ───────────────────────┘
            ── Published(N) (control channel) ──► wakes it; distributed: DistributedWeights loads N

Main loop, step n: wait for batch n from the sink (backpressure point: the trainer pulls batches, and
admission stops dispatch when `next_batch_step - served_version > K`), cut it (the group table moves the
groups to trained, admission re-checks, unshippable in-flight groups are cancelled), checkpoint (before
the batch can reach the trainer), send it, check the group table, log metrics.

`deterministic = true` adds one shared `DeterministicSchedule` (`schedule.py`) to admission, the
dispatcher, the sink (`DeterministicSink`) and the watcher (version by version, `drain` updates).

Construction order has no cycle: env mix -> group table -> admission, sink -> dispatcher -> watcher;
every component that needs to know where a group is reads the one group table.
A planned stop (SIGTERM / SIGINT; one during start-up is taken when the loop starts) freezes generation
and checkpoints everything generated, in flight included (`planned_stop.py`); a resume carries that work
over (`carry.py`).
Background tasks (dispatcher, weight watcher, in-run eval) are supervised: a failure of any ends the main
loop with that exception; shutdown cancels them with a timeout. With an eval configured, the loop holds
admission after the last batch (no new training group) and waits for the final version's eval
(`eval/in_run.py`); eval episodes never enter the group table.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineClient
from prime_async.eval.in_run import InRunEval
from prime_async.eval.setup import merged_sampling
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.carry import Carry, snapshot
from prime_async.orchestrator.ckpt import latest_checkpoint, save_checkpoint
from prime_async.orchestrator.components import Components
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.dispatcher import Dispatcher, episode_key
from prime_async.orchestrator.engine_load import EngineLoad
from prime_async.orchestrator.env_mix import EnvMix, MixEnv
from prime_async.orchestrator.episode_log import EpisodeLog
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.length_bias import LengthBias
from prime_async.orchestrator.metrics import batch_metrics
from prime_async.orchestrator.planned_stop import (
    EXIT_PLANNED_STOP,
    PlannedStop,
    stop_and_save,
    stop_on_signals,
)
from prime_async.orchestrator.schedule import DeterministicSchedule
from prime_async.orchestrator.train_sink import build_train_sink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.engine_checks import (
    check_engines_belong_to_run,
    check_served_not_ahead,
    wait_for_engines,
)
from prime_async.rollouts.sources import build_sources, source_metrics
from prime_async.rollouts.teacher import TeacherScorer
from prime_async.rollouts.types import RolloutSource
from prime_async.transport.types import TrainBatch
from prime_async.utils.stall import StallWatch, waiting
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher import BroadcastDir, Broadcasts, UpdateSignal, WeightLoader, WeightWatcher

if TYPE_CHECKING:
    from prime_async.transport.zmq_batches import BatchSender

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


def build_env_mix(cfg: OrchestratorConfig, sources: Mapping[str, RolloutSource]) -> EnvMix:
    """The training environments of `cfg.envs` over their (started) sources, keyed by env name."""
    envs = []
    for env_cfg in cfg.envs:
        source = sources[env_cfg.label]
        data = DataSource(num_examples=source.num_examples, seed=cfg.seed, shuffle=cfg.shuffle)
        sampling = merged_sampling(cfg.sampling, env_cfg.sampling)
        envs.append(MixEnv(env_cfg.label, source, data, sampling, ratio=env_cfg.ratio))
    return EnvMix(envs)


def build_components(
    cfg: OrchestratorConfig,
    *,
    source: RolloutSource | Mapping[str, RolloutSource],
    engines: Sequence[EngineClient],
    broadcasts: Broadcasts,
    served_version: int,
    clock: Callable[[], float] = time.monotonic,
    loader: WeightLoader | None = None,
    request_gate: RequestGate | None = None,
    stalls: StallWatch | None = None,
    signal: UpdateSignal | None = None,
    teacher: TeacherScorer | None = None,
    episode_log: EpisodeLog | None = None,
) -> Components:
    """Build every component from `cfg`; restore the data positions and the mix when `cfg.resume`.

    `source` is the rollout source of each training env by name (a single source serves a one-env run);
    `request_gate` is the one gate every gateway in front of the training engines passes, `signal` what
    the control channel wakes the watcher with; both are built first (`_run`) and given to the watcher."""
    if not isinstance(source, Mapping):
        source = {env.label: source for env in cfg.envs}
    envs = build_env_mix(cfg, source)
    start_step, saved = _restore(cfg, envs)
    length_bias = LengthBias()
    carry = None
    if saved.get("carry") and not cfg.deterministic:
        carry = Carry(saved["carry"], served_version=served_version)
    groups = GroupTable(
        group_size=cfg.group_size,
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        data=envs,
        retry_unused=cfg.unused_handler == "retry",
        retry_cancelled=not cfg.deterministic,
        max_dropped_groups_per_step=cfg.resolved_max_dropped_groups_per_step,
        next_batch_step=start_step,
    )
    schedule = _schedule(cfg, start_step)
    admission = AdmissionController(
        groups=groups,
        max_inflight_groups=cfg.resolved_max_inflight_groups,
        max_buffered_groups=cfg.resolved_max_buffered_groups,
        granularity=cfg.submission_granularity,
        served_version=served_version,
        clock=clock,
        schedule=schedule,
    )
    sink = build_train_sink(
        cfg=cfg.sink,
        schedule=schedule,
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        seq_len=cfg.seq_len,
        groups=groups,
    )
    dispatcher = Dispatcher(
        envs=envs,
        admission=admission,
        groups=groups,
        sink=sink,
        clock=clock,
        fail_fast_groups=cfg.fail_fast_groups,
        schedule=schedule,
        teacher=teacher,
        episode_log=episode_log,
        carry=carry,
        length_bias=length_bias,
    )
    watcher = WeightWatcher(
        engines=engines,
        broadcasts=broadcasts,
        admission=admission,
        groups=groups,
        pause_mode="drain" if schedule is not None else cfg.weights.pause_mode,
        update_interval=cfg.weights.update_interval,
        poll_interval_s=cfg.weights.poll_interval_s,
        clock=clock,
        schedule=schedule,
        loader=loader,
        request_gate=request_gate,
        stalls=stalls,
        signal=signal,
    )
    return Components(
        envs, groups, admission, dispatcher, sink, watcher, start_step, teacher, EngineLoad(engines), carry,
        length_bias,
    )  # fmt: skip


def _schedule(cfg: OrchestratorConfig, start_step: int) -> DeterministicSchedule | None:
    if not cfg.deterministic:
        return None
    logger.info("deterministic: fixed dispatch schedule, seeded sampling, drain weight updates")
    return DeterministicSchedule(
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        max_steps=cfg.max_steps,
        seed=cfg.seed,
        start_step=start_step,
    )


def _restore(cfg: OrchestratorConfig, envs: EnvMix) -> tuple[int, dict[str, Any]]:
    """The first step and the checkpoint resumed from ({} when none)."""
    if not cfg.resume:
        return 0, {}
    state = latest_checkpoint(cfg.output_dir)
    if state is None:
        logger.warning("resume = true but no orchestrator checkpoint in %s: start at step 0", cfg.output_dir)
        return 0, {}
    envs.load_state_dict(state)
    how = " (a planned stop)" if state.get("planned_stop") else ""
    logger.info("resumed from orchestrator checkpoint of step %d%s", state["step"], how)
    return int(state["step"]) + 1, state


def checkpoint_state(comps: Components, pending: list[Group] | None = None) -> dict[str, Any]:
    """Every env's data position + its prompts issued but not trained (`pending`, default: buffered
    first, then in flight), the mix schedule, and the pending groups' work (`carry.py`; none in
    deterministic runs) followed by the work this lifetime was handed and has not taken yet. No await."""
    pending = comps.groups.pending_groups() if pending is None else pending
    state = comps.envs.state_dict(pending=pending)
    if comps.dispatcher.schedule is None:
        state["carry"] = snapshot(pending, comps.groups.group_size, functools.partial(_recorded_calls, comps))
        state["carry"] += comps.carry.untaken() if comps.carry is not None else []
    return state


def _recorded_calls(comps: Components, group: Group, index: int) -> list[Any]:
    recorded = getattr(comps.envs.get(group.env).source, "recorded_calls", None)
    return recorded(episode_key(group, index)) if recorded is not None else []


async def _supervised(aw: Awaitable[Any], background: list[asyncio.Task]) -> Any:
    """Await `aw`, but raise at once if a background task fails or exits."""
    main = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait([main, *background], return_when=asyncio.FIRST_COMPLETED)
    if main in done:
        return main.result()
    main.cancel()
    for task in background:
        if task.done():
            exc = None if task.cancelled() else task.exception()
            raise exc or RuntimeError(f"background task {task.get_name()} exited unexpectedly")
    raise AssertionError("unreachable")


async def run_loop(
    cfg: OrchestratorConfig,
    comps: Components,
    *,
    send_batch: Callable[[TrainBatch], Awaitable[None]],
    log_metrics: Callable[[dict[str, float], int], None],
    on_step: Callable[[int, list[Group]], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    evaluator: InRunEval | None = None,
    stalls: StallWatch | None = None,
    stop: asyncio.Event | None = None,
    delivered: Callable[[], int | None] | None = None,
    stop_serving: Callable[[], int | None] | None = None,
) -> None:
    """Produce batches `start_step .. max_steps-1`, then (with `evaluator`) wait for the final eval;
    background tasks are supervised and stopped at exit; every wait is named to `stalls`. `stop` set:
    a planned stop (`planned_stop.py`) saves the run and raises PlannedStop; `delivered()`: the newest
    batch step every trainer rank fetched (None: sent is fetched); `stop_serving()`: freezes the batch
    stream and returns the newest step fetched, in one atomic step (`BatchSender.stop_serving`): the
    planned-stop checkpoint is taken at that step, and the trainer can fetch nothing newer from this
    lifetime (default: `delivered`, for batch streams without a sender thread)."""
    background = [
        asyncio.create_task(comps.dispatcher.run(), name="dispatcher"),
        asyncio.create_task(comps.watcher.run(), name="weight-watcher"),
    ]
    if evaluator is not None:
        background.append(asyncio.create_task(evaluator.run(), name="eval"))
    if stop is not None:
        background.append(asyncio.create_task(_planned_stop_when(stop), name="planned-stop"))
    fetched = delivered or (lambda: max(comps.undelivered, default=None))
    try:
        try:
            await _produce(cfg, comps, background, send_batch=send_batch, log_metrics=log_metrics,
                           on_step=on_step, clock=clock, evaluator=evaluator, stalls=stalls,
                           fetched=fetched)  # fmt: skip
        except PlannedStop:
            newest = (stop_serving or fetched)()
            await stop_and_save(
                cfg.output_dir, comps, delivered=max(-1 if newest is None else newest, comps.start_step - 1),
                undelivered=comps.undelivered, watcher_task=background[1], state=checkpoint_state,
            )  # fmt: skip
            raise
    finally:
        await _shutdown(comps, background)


async def _planned_stop_when(stop: asyncio.Event) -> None:
    await stop.wait()
    raise PlannedStop("the orchestrator was asked to stop")


async def _produce(
    cfg: OrchestratorConfig,
    comps: Components,
    background: list[asyncio.Task],
    *,
    send_batch: Callable[[TrainBatch], Awaitable[None]],
    log_metrics: Callable[[dict[str, float], int], None],
    on_step: Callable[[int, list[Group]], None] | None,
    clock: Callable[[], float],
    evaluator: InRunEval | None,
    stalls: StallWatch | None,
    fetched: Callable[[], int | None],
) -> None:
    last = clock()
    for step in range(comps.start_step, cfg.max_steps):
        with waiting(stalls, f"the groups of batch {step}", peer=lambda: _batch_peer(cfg, comps)):
            groups = await _supervised(comps.sink.get_batch(step), background)
        wait_data = clock() - last
        batch = build_train_batch(
            groups,
            step=step,
            seq_len=cfg.seq_len,
            num_ranks=cfg.num_train_ranks,
            temperature=cfg.sampling.temperature,
            advantage_cfg=cfg.advantage,
            share_prefix=cfg.share_prompt_prefix,
            teacher=cfg.teacher,
        )
        batch.metrics["batch/lifetime_start"] = float(comps.start_step)  # whose batch the trainer trains
        comps.length_bias.trained(groups)
        comps.undelivered[step] = groups  # until the trainer fetched it: a planned stop carries them
        if on_step is not None:
            on_step(step, groups)
        # Checkpoint before the batch can reach the trainer: a death between the two must never leave
        # a trainer checkpoint of step + 1 without the orchestrator's of `step` (the rollback would
        # resume the orchestrator behind engines serving step + 1, and die again, until the restart
        # budget is gone). The state is final here: the cut moved the batch's groups to trained.
        if cfg.ckpt.interval is not None and (step + 1) % cfg.ckpt.interval == 0:
            save_checkpoint(cfg.output_dir, step, checkpoint_state(comps))
        time_cut = clock() - last - wait_data
        with waiting(stalls, f"batch {step} to be fetched", peer="the trainer"):
            await _supervised(send_batch(batch), background)
        _forget_fetched(comps, fetched())
        comps.groups.check()
        now = clock()
        metrics = _step_metrics(comps, groups, step, time_step=now - last, wait_data=wait_data)
        metrics.update(batch.metrics)  # batch/sample_tokens, batch/packed_tokens
        metrics["time/cut"] = time_cut
        if comps.engine_load is not None:
            metrics.update(await comps.engine_load.window_metrics())
        last = now
        log_metrics(metrics, step)
    if evaluator is not None:
        comps.admission.hold()  # nothing more will be trained: leave the engines to the final eval
        with waiting(stalls, "the final version's eval", peer="the eval engines"):
            await _supervised(evaluator.finish(cfg.eval.final_timeout_s), background)


def _forget_fetched(comps: Components, newest_fetched: int | None) -> None:
    for step in [s for s in comps.undelivered if newest_fetched is not None and s <= newest_fetched]:
        del comps.undelivered[step]


def _batch_peer(cfg: OrchestratorConfig, comps: Components) -> str:
    """Who the batch wait waits on now: a teacher outage, else admission's blocking reason names it."""
    if comps.teacher is not None and (outage := comps.teacher.outage_line()) is not None:
        return outage
    reason = comps.admission.blocked_reason()
    served, step = comps.admission.served_version, comps.groups.next_batch_step
    if reason == "off_policy":
        needed, latest = step - cfg.max_off_policy_steps, comps.watcher.latest() or 0
        if latest >= needed:  # published, not loaded yet: the update waits on the engines
            return (
                f"the inference engines: weights v{latest} are published, the engines still serve v{served}"
            )
        return f"the trainer: batch {step} needs weights v{needed} or newer, the engines serve v{served}"
    if reason == "hold":
        return f"a weight update or an engine outage (admission held; engines serve v{served})"
    return f"the inference engines ({comps.groups.num_inflight_groups} groups in flight)"


def stall_state(comps: Components, sources: Mapping[str, Any], control: Any) -> dict[str, Any]:
    """The orchestrator's part of a stall report (`utils/stall.py`): where the run is and what each
    peer last did."""
    now = time.monotonic()
    pending: dict[str, int] = {}
    heard: dict[str, float | None] = {}
    for source in sources.values():
        gateway = getattr(source, "gateway", None)
        if gateway is None:
            continue
        for url, n in gateway.pending_by_engine().items():
            pending[url] = pending.get(url, 0) + n
        for url, t in gateway.last_answer.items():
            heard[f"engine {url}"] = round(now - t, 3)
    heard["trainer"] = None if control.last_heard is None else round(now - control.last_heard, 3)
    teacher = {} if comps.teacher is None else {"teacher": comps.teacher.describe()}
    return {
        "next_batch_step": comps.groups.next_batch_step,
        "served_version": comps.admission.served_version,
        "admission_blocked_by": comps.admission.blocked_reason(),
        "inflight_groups": comps.groups.num_inflight_groups,
        "buffered_groups": comps.groups.num_buffered_groups,
        "pending_requests_per_engine": pending,
        "last_heard_s_ago": heard,
        **teacher,
    }


def _step_metrics(
    comps: Components, groups: list[Group], step: int, *, time_step: float, wait_data: float
) -> dict[str, float]:
    metrics = batch_metrics(groups, step, list(comps.envs.envs))
    metrics.update(comps.envs.metrics())
    metrics.update(comps.groups.window_metrics())
    metrics.update(comps.admission.window_metrics())
    metrics.update(comps.dispatcher.window_metrics())
    metrics.update(comps.watcher.window_metrics())
    if comps.teacher is not None:
        metrics.update(comps.teacher.window_metrics())
    if comps.carry is not None:
        metrics.update(comps.carry.metrics())
    metrics.update(comps.length_bias.metrics())
    comps.length_bias.warn_if_biased()
    metrics["time/step"] = time_step
    metrics["time/wait_data"] = wait_data
    return metrics


async def _shutdown(comps: Components, background: list[asyncio.Task]) -> None:
    for task in background:
        task.cancel()
    try:
        await asyncio.wait_for(
            asyncio.gather(*background, comps.dispatcher.stop(), return_exceptions=True),
            timeout=SHUTDOWN_TIMEOUT_S,
        )
    except TimeoutError:
        logger.error("orchestrator background tasks did not stop within %.0f s", SHUTDOWN_TIMEOUT_S)


async def _start_teacher(
    cfg: OrchestratorConfig, stack: contextlib.AsyncExitStack, stalls: StallWatch
) -> TeacherScorer | None:
    """The teacher's scorer (on-policy distillation), once its engines answer /health; closed by `stack`."""
    if cfg.teacher is None:
        return None
    teacher = TeacherScorer(
        cfg.teacher, temperature=cfg.sampling.temperature, deterministic=cfg.deterministic
    )
    stack.push_async_callback(teacher.aclose)
    with stalls.waiting("the teacher's engines to answer /health", peer="the teacher engines"):
        await wait_for_engines(teacher.clients, timeout_s=cfg.inference.timeout_s)
    urls, t = ", ".join(cfg.teacher.base_urls), cfg.teacher
    logger.info(
        "teacher: %s scores every episode (kl_weight %g, env_weight %g)", urls, t.kl_weight, t.env_weight
    )
    return teacher


def _console_line(step: int, m: dict[str, float]) -> str:
    return (
        f"step {step} | reward {m['reward/mean']:.3f} | staleness {m['rollout/data_staleness/mean']:.2f} "
        f"(max {m['rollout/data_staleness/max']:.0f}) | inflight {m['rollout/buffer/inflight_groups']:.0f} "
        f"buffer {m['rollout/buffer/size']:.0f} dropped {m['rollout/buffer/dropped_groups']:.0f} | "
        f"step {m['time/step']:.2f}s wait {m['time/wait_data']:.2f}s sync {m['time/sync_weights']:.2f}s | "
        f"{m['rollout/tokens_per_s']:.0f} completion tok/s finished"
    )


def run(cfg: OrchestratorConfig) -> None:
    """Production entry: HTTP engines, verifiers rollout source, ZMQ batch sender, Monitor. A planned
    stop (SIGTERM/SIGINT) exits with EXIT_PLANNED_STOP after saving the run."""
    try:
        asyncio.run(_run(cfg))
    except PlannedStop:
        logger.warning("orchestrator stopped as asked; resume = true continues with the work saved")
        raise SystemExit(EXIT_PLANNED_STOP) from None


async def _run(cfg: OrchestratorConfig) -> None:
    """One lifetime of the orchestrator. SIGTERM/SIGINT are handled from its first line to its last (and
    ignored after it, `planned_stop.stop_on_signals`): a signal never ends the process by default."""
    with stop_on_signals() as stop:
        await _run_lifetime(cfg, stop)


async def _run_lifetime(cfg: OrchestratorConfig, stop: asyncio.Event) -> None:
    from prime_async.inference.client import engine_clients
    from prime_async.orchestrator import wiring
    from prime_async.transport.zmq_batches import BatchSender
    from prime_async.utils.monitor import Monitor
    from prime_async.weights.transfer import build_control

    inf = cfg.inference
    engines = engine_clients(
        inf.base_urls, inf.api_key, lora=cfg.lora is not None, routed_experts=cfg.router_replay
    )
    signal, gate = UpdateSignal(), RequestGate()  # given to the control channel, gateways and watcher
    control, loader = build_control(cfg, signal)
    sources = build_sources(
        list(cfg.envs), engines, model_path=cfg.model.path, seq_len=cfg.seq_len, gate=gate
    )
    config = cfg.model_dump(mode="json")
    monitor = Monitor(output_dir=cfg.output_dir, name="orchestrator", wandb_cfg=cfg.wandb, config=config)
    sender = BatchSender(cfg=cfg.transport, num_ranks=cfg.num_train_ranks)

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        metrics.update(source_metrics(sources))
        logger.info(_console_line(step, metrics))
        monitor.log(metrics, step=step)

    async def send_batch(batch: TrainBatch) -> None:
        # blocks until every trainer rank said READY; the socket lives in the sender's own thread
        await asyncio.to_thread(sender.send, batch)

    stalls = StallWatch(
        component="orchestrator", output_dir=cfg.output_dir, stall_after_s=cfg.log.stall_after_s
    ).start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            # envs load (verifiers import, tasks, gateways) while the engines start: nothing here talks
            # to an engine before it is healthy and proven to belong to this run
            for source in sources.values():
                await stack.enter_async_context(source)
            with stalls.waiting("the engines to answer /health", peer="the inference engines"):
                await wait_for_engines(engines, timeout_s=cfg.inference.timeout_s)
            await check_engines_belong_to_run(
                engines, cfg.run_id, model_path=str(cfg.model.path), broadcasts=cfg.output_dir / "broadcasts"
            )
            teacher = await _start_teacher(cfg, stack, stalls)
            episode_log = EpisodeLog(cfg.output_dir)
            stack.callback(episode_log.close)
            versions = await asyncio.gather(*(e.weight_version() for e in engines))
            served = min(versions)
            comps = build_components(
                cfg,
                source=sources,
                engines=engines,
                broadcasts=BroadcastDir(cfg.output_dir / "broadcasts"),
                served_version=served,
                loader=loader,
                request_gate=gate,
                stalls=stalls,
                signal=signal,
                teacher=teacher,
                episode_log=episode_log,
            )
            stalls.describe = functools.partial(stall_state, comps, sources, control)
            check_served_not_ahead(max(versions), comps.start_step)
            logger.info("engines serve weight version %d; first batch is step %d", served, comps.start_step)
            evaluator = await wiring.start_in_run_eval(
                cfg, comps.watcher, engines=engines, monitor=monitor, stack=stack
            )
            # a signal during start-up set `stop` already: the loop takes the planned stop at once
            await run_loop(cfg, comps, send_batch=send_batch, log_metrics=log_metrics,
                           evaluator=evaluator, stalls=stalls, stop=stop,
                           delivered=sender.delivered_step, stop_serving=sender.stop_serving)  # fmt: skip
        with stalls.waiting("the final batch to be fetched", peer="the trainer"):
            await _drain_last_batch(sender, cfg)
    finally:
        stalls.stop()
        await control.close()
        sender.close()
        monitor.close()
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)


async def _drain_last_batch(sender: BatchSender, cfg: OrchestratorConfig) -> None:
    """Keep serving until the trainer has fetched the final batch (the stream is pull-based).

    Only a lifetime that sent the final batch waits: an orchestrator restarted after the last step's
    checkpoint sends nothing, and would otherwise wait `transport.timeout_s` for a batch it never had."""
    last = cfg.max_steps - 1
    if sender.last_step != last:
        logger.info("batch %d was sent by an earlier lifetime of the orchestrator: nothing to drain", last)
        return
    delivered = await asyncio.to_thread(sender.wait_delivered, last, cfg.transport.timeout_s)
    if not delivered:
        timeout = cfg.transport.timeout_s
        logger.warning("trainer did not fetch batch %d within %.0f s; exiting anyway", last, timeout)
