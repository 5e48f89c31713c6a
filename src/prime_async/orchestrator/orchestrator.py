"""The orchestrator process: wires the components and runs the main loop. No component imports this.

    DataSource ─► Dispatcher ─(Admission)─► RolloutSource (verifiers env ─► gateway ─► engines)
                      │  finished groups                                        ▲
                      ▼                                                         │ pause / update / resume
                  TrainSink ── get_batch(n): sweep vs K, take oldest ─► build_train_batch ─► BatchSender
                                                                                │ (ZMQ, pull by trainer)
    trainer ── broadcasts/step_N/STABLE ──► WeightWatcher ───────────────────────┘

Main loop, step n: wait for batch n from the sink (backpressure point: the trainer pulls batches, and
admission stops dispatch when `next_batch_step - served_version > K`), cut it (admission re-checks,
unshippable in-flight groups are cancelled), send it, check the ledger, log metrics, checkpoint.
Background tasks (dispatcher, weight watcher) are supervised: a failure of either ends the main loop with
that exception; shutdown cancels them with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.inference.types import EngineClient
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.ckpt import latest_checkpoint, save_checkpoint
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.dispatcher import Dispatcher
from prime_async.orchestrator.ledger import Ledger
from prime_async.orchestrator.metrics import batch_metrics
from prime_async.orchestrator.train_sink import TrainSink, build_train_sink
from prime_async.orchestrator.types import Group, RolloutSource
from prime_async.orchestrator.weight_watcher import BroadcastDir, Broadcasts, WeightWatcher
from prime_async.transport.types import TrainBatch

if TYPE_CHECKING:
    from prime_async.transport.zmq_batches import BatchSender

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class Components:
    data: DataSource
    admission: AdmissionController
    ledger: Ledger
    dispatcher: Dispatcher
    sink: TrainSink
    watcher: WeightWatcher
    start_step: int = 0


def sampling_params(cfg: OrchestratorConfig) -> dict[str, Any]:
    s = cfg.sampling
    return {"temperature": s.temperature, "max_tokens": s.max_tokens, "top_p": s.top_p}


def build_components(
    cfg: OrchestratorConfig,
    *,
    source: RolloutSource,
    engines: Sequence[EngineClient],
    broadcasts: Broadcasts,
    served_version: int,
    clock: Callable[[], float] = time.monotonic,
) -> Components:
    """Build every component from `cfg`; restore the data position when `cfg.resume`."""
    data = DataSource(num_examples=source.num_examples, seed=cfg.seed, shuffle=cfg.shuffle)
    start_step = _restore(cfg, data)
    ledger = Ledger()
    sink_box: list[TrainSink] = []
    admission = AdmissionController(
        max_inflight_groups=cfg.resolved_max_inflight_groups,
        max_buffered_groups=cfg.resolved_max_buffered_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        group_size=cfg.group_size,
        granularity=cfg.submission_granularity,
        buffered_groups=lambda: sink_box[0].num_buffered_groups,
        served_version=served_version,
        next_batch_step=start_step,
        clock=clock,
    )
    dispatcher = Dispatcher(
        source=source,
        data=data,
        admission=admission,
        ledger=ledger,
        group_size=cfg.group_size,
        sampling=sampling_params(cfg),
        retry_unused=cfg.unused_handler == "retry",
        clock=clock,
    )
    sink = build_train_sink(
        cfg=cfg.sink,
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        seq_len=cfg.seq_len,
        unused_handler=cfg.unused_handler,
        max_dropped_groups_per_step=cfg.resolved_max_dropped_groups_per_step,
        listener=dispatcher,
    )
    sink_box.append(sink)
    dispatcher.attach_sink(sink)
    watcher = WeightWatcher(
        engines=engines,
        broadcasts=broadcasts,
        admission=admission,
        dispatcher=dispatcher,
        pause_mode=cfg.pause_mode,
        update_weights_interval=cfg.update_weights_interval,
        poll_interval_s=cfg.weight_poll_interval_s,
        clock=clock,
    )
    return Components(data, admission, ledger, dispatcher, sink, watcher, start_step)


def _restore(cfg: OrchestratorConfig, data: DataSource) -> int:
    if not cfg.resume:
        return 0
    state = latest_checkpoint(cfg.output_dir)
    if state is None:
        logger.warning("resume = true but no orchestrator checkpoint in %s: start at step 0", cfg.output_dir)
        return 0
    data.load_state_dict(state["data"])
    logger.info("resumed from orchestrator checkpoint of step %d", state["step"])
    return int(state["step"]) + 1


def checkpoint_state(comps: Components) -> dict[str, Any]:
    """Data position + prompts issued but not trained (sink queue first, then in flight). No await."""
    pending = comps.sink.pending_examples() + comps.dispatcher.pending_examples()
    return {"data": comps.data.state_dict(pending=pending)}


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
) -> None:
    """Produce batches `start_step .. max_steps-1`; background tasks are supervised and stopped at exit."""
    background = [
        asyncio.create_task(comps.dispatcher.run(), name="dispatcher"),
        asyncio.create_task(comps.watcher.run(), name="weight-watcher"),
    ]
    try:
        last = clock()
        for step in range(comps.start_step, cfg.max_steps):
            groups = await _supervised(comps.sink.get_batch(step), background)
            wait_data = clock() - last
            batch = build_train_batch(
                groups,
                step=step,
                seq_len=cfg.seq_len,
                num_ranks=cfg.num_train_ranks,
                temperature=cfg.sampling.temperature,
                advantage_cfg=cfg.advantage,
            )
            if on_step is not None:
                on_step(step, groups)
            await _supervised(send_batch(batch), background)
            comps.ledger.check(
                inflight=comps.dispatcher.num_inflight_episodes, buffered=comps.sink.num_buffered_episodes
            )
            if cfg.ckpt.interval is not None and (step + 1) % cfg.ckpt.interval == 0:
                save_checkpoint(cfg.output_dir, step, checkpoint_state(comps))
            now = clock()
            metrics = _step_metrics(comps, groups, step, time_step=now - last, wait_data=wait_data)
            last = now
            log_metrics(metrics, step)
    finally:
        await _shutdown(comps, background)


def _step_metrics(
    comps: Components, groups: list[Group], step: int, *, time_step: float, wait_data: float
) -> dict[str, float]:
    metrics = batch_metrics(groups, step)
    metrics.update(comps.sink.get_metrics())
    metrics.update(comps.admission.window_metrics())
    metrics.update(comps.dispatcher.window_metrics())
    metrics.update(comps.watcher.window_metrics())
    metrics.update(comps.ledger.metrics())
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


def _console_line(step: int, m: dict[str, float]) -> str:
    return (
        f"step {step} | reward {m['reward/mean']:.3f} | staleness {m['rollout/data_staleness/mean']:.2f} "
        f"(max {m['rollout/data_staleness/max']:.0f}) | inflight {m['rollout/buffer/inflight_groups']:.0f} "
        f"buffer {m['rollout/buffer/size']:.0f} dropped {m['rollout/buffer/dropped_groups']:.0f} | "
        f"step {m['time/step']:.2f}s wait {m['time/wait_data']:.2f}s sync {m['time/sync_weights']:.2f}s | "
        f"{m['rollout/tokens_per_s']:.0f} tok/s"
    )


def run(cfg: OrchestratorConfig) -> None:
    """Production entry: HTTP engines, verifiers rollout source, ZMQ batch sender, Monitor."""
    asyncio.run(_run(cfg))


async def wait_for_engines(engines: Sequence[EngineClient], *, timeout_s: float) -> None:
    """Poll `/health` of every engine until all answer (the launcher starts inference first)."""
    deadline = time.monotonic() + timeout_s
    while not all(await asyncio.gather(*(e.health() for e in engines))):
        if time.monotonic() > deadline:
            urls = [e.base_url for e in engines]
            raise RuntimeError(f"inference engines {urls} not healthy after {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def _run(cfg: OrchestratorConfig) -> None:
    from prime_async.inference.client import HttpEngineClient
    from prime_async.orchestrator.envs import build_rollout_source
    from prime_async.transport.zmq_batches import BatchSender
    from prime_async.utils.monitor import Monitor

    engines = [HttpEngineClient(url, cfg.inference.api_key) for url in cfg.inference.base_urls]
    source = build_rollout_source(
        env_cfg=cfg.env, engines=engines, model_path=cfg.model.path, seq_len=cfg.seq_len
    )
    config = cfg.model_dump(mode="json")
    monitor = Monitor(output_dir=cfg.output_dir, name="orchestrator", wandb_cfg=cfg.wandb, config=config)
    sender = BatchSender(cfg=cfg.transport, num_ranks=cfg.num_train_ranks)

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        metrics.update(source.metrics())
        logger.info(_console_line(step, metrics))
        monitor.log(metrics, step=step)

    async def send_batch(batch: TrainBatch) -> None:
        # blocks until every trainer rank said READY; the socket lives in the sender's own thread
        await asyncio.to_thread(sender.send, batch)

    try:
        await wait_for_engines(engines, timeout_s=cfg.inference.timeout_s)
        async with source:
            served = min(await asyncio.gather(*(e.weight_version() for e in engines)))
            comps = build_components(
                cfg,
                source=source,
                engines=engines,
                broadcasts=BroadcastDir(cfg.output_dir / "broadcasts"),
                served_version=served,
            )
            gateway = getattr(source, "gateway", None)
            if gateway is not None:  # engine outages seen by episodes hold dispatch at once
                gateway.on_engine_error = comps.watcher.engine_failed
            await run_loop(cfg, comps, send_batch=send_batch, log_metrics=log_metrics)
        await _drain_last_batch(sender, cfg)
    finally:
        sender.close()
        monitor.close()
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)


async def _drain_last_batch(sender: BatchSender, cfg: OrchestratorConfig) -> None:
    """Keep serving until the trainer has fetched the final batch (the stream is pull-based)."""
    last = cfg.max_steps - 1
    delivered = await asyncio.to_thread(sender.wait_delivered, last, cfg.transport.timeout_s)
    if not delivered:
        timeout = cfg.transport.timeout_s
        logger.warning("trainer did not fetch batch %d within %.0f s; exiting anyway", last, timeout)
