"""The orchestrator process's production entry (`run`): the composition root of one lifetime.

    open the lifetime's I/O: engine clients, update signal + request gate, control channel (+ loader),
    rollout sources, monitor, batch sender, stall watch
      ──► start: sources, engines healthy and of this run, teacher, episode log, served version
      ──► build_components (`components.py`) ──► start the in-run eval (`eval/in_run_start.py`)
      ──► run_loop (`orchestrator.py`) ──► serve the final batch until fetched ──► close the I/O

A planned stop (SIGTERM / SIGINT; one during start-up is taken when the loop starts) freezes generation
and checkpoints everything generated, in flight included (`planned_stop.py`); a resume carries that work
over (`carry.py`). Nothing talks to an engine before it is healthy and proven to belong to this run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineClient
from prime_async.eval.in_run_start import start_in_run_eval
from prime_async.orchestrator.components import ComponentInputs, Components, build_components
from prime_async.orchestrator.engine_pool import start_engine_pool
from prime_async.orchestrator.episode_log import EpisodeLog
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.orchestrator.planned_stop import EXIT_PLANNED_STOP, PlannedStop, stop_on_signals
from prime_async.rollouts.engine_checks import (
    check_engines_belong_to_run,
    check_served_not_ahead,
    wait_for_engines,
)
from prime_async.rollouts.env_sources import build_sources, source_metrics
from prime_async.rollouts.teacher import TeacherScorer
from prime_async.rollouts.types import RolloutSource
from prime_async.transport.types import TrainBatch
from prime_async.utils.stall import StallWatch
from prime_async.weights.loaders.base import WeightLoader
from prime_async.weights.probe_check import WeightProbe
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher import UpdateSignal

if TYPE_CHECKING:
    from prime_async.transport.zmq_batches import BatchSender
    from prime_async.utils.monitor import Monitor
    from prime_async.weights.control import ControlServer

logger = logging.getLogger(__name__)


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


@dataclass
class LifetimeIO:
    """The lifetime's connections to the outside, opened before the components and closed after them.
    `signal` and `gate` are given to the control channel, the gateways and the watcher alike."""

    engines: list[EngineClient]
    signal: UpdateSignal
    gate: RequestGate
    control: ControlServer
    loader: WeightLoader
    sources: dict[str, RolloutSource]
    monitor: Monitor
    sender: BatchSender
    stalls: StallWatch
    probe: WeightProbe | None = None  # the check after every weight load (weights/probe_check.py)

    async def close(self) -> None:
        self.stalls.stop()
        await self.control.close()
        self.sender.close()
        self.monitor.close()
        await asyncio.gather(*(e.aclose() for e in self.engines), return_exceptions=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        metrics.update(source_metrics(self.sources))
        logger.info(_console_line(step, metrics))
        self.monitor.log(metrics, step=step)

    async def send_batch(self, batch: TrainBatch) -> None:
        # blocks until every trainer rank said READY; the socket lives in the sender's own thread
        await asyncio.to_thread(self.sender.send, batch)


def _open(cfg: OrchestratorConfig) -> LifetimeIO:
    from prime_async.inference.client import engine_clients
    from prime_async.transport.zmq_batches import BatchSender
    from prime_async.utils.monitor import Monitor
    from prime_async.weights.loaders import build_control

    inf = cfg.inference
    engines = engine_clients(
        inf.base_urls, inf.api_key, lora=inf.lora is not None, routed_experts=inf.router_replay
    )
    signal, gate = UpdateSignal(), RequestGate()
    probe = _weight_probe(cfg, engines)
    control, loader = build_control(cfg, signal, on_probe=probe.remember if probe is not None else None)
    sources = build_sources(
        list(cfg.envs), engines, model_path=cfg.model.path, seq_len=cfg.seq_len, gate=gate
    )
    config = cfg.model_dump(mode="json")
    monitor = Monitor(output_dir=cfg.output_dir, name="orchestrator", wandb_cfg=cfg.wandb, config=config)
    sender = BatchSender(cfg=cfg.transport, num_ranks=cfg.batch.packing.num_train_ranks)
    stalls = StallWatch(
        component="orchestrator", output_dir=cfg.output_dir, stall_after_s=cfg.log.stall_after_s
    ).start()
    return LifetimeIO(engines, signal, gate, control, loader, sources, monitor, sender, stalls, probe)


def _weight_probe(cfg: OrchestratorConfig, engines: list[EngineClient]) -> WeightProbe | None:
    """The weight probe over the engines (`weights.probe`); None when off, for LoRA runs (the engines
    score the base model), or when an engine is not an HTTP engine (a test double)."""
    from prime_async.inference.client import HttpEngineClient

    scorers = [e for e in engines if isinstance(e, HttpEngineClient)]
    if not cfg.weights.probe.enabled or cfg.inference.lora is not None or len(scorers) != len(engines):
        return None
    return WeightProbe(cfg.weights.probe, engines)  # type: ignore[arg-type]  # the live list (engine_pool.py)


async def _run_lifetime(cfg: OrchestratorConfig, stop: asyncio.Event) -> None:
    io = _open(cfg)
    try:
        async with contextlib.AsyncExitStack() as stack:
            comps = await _start(cfg, io, stack)
            await start_engine_pool(cfg, io.engines, comps, stack)  # rl-engines add|remove (elastic.md)
            evaluator = await start_in_run_eval(
                cfg, comps.watcher, engines=io.engines, monitor=io.monitor, stack=stack
            )
            # a signal during start-up set `stop` already: the loop takes the planned stop at once
            await run_loop(
                cfg, comps, send_batch=io.send_batch, log_metrics=io.log_metrics, evaluator=evaluator,
                stalls=io.stalls, stop=stop, delivered=io.sender.delivered_step,
                stop_serving=io.sender.stop_serving,
            )  # fmt: skip
        with io.stalls.waiting("the final batch to be fetched", peer="the trainer"):
            await _drain_last_batch(io.sender, cfg)
    finally:
        await io.close()


async def _start(cfg: OrchestratorConfig, io: LifetimeIO, stack: contextlib.AsyncExitStack) -> Components:
    """Start the sources, wait for the engines (and the teacher's), then build the components."""
    # envs load (verifiers import, tasks, gateways) while the engines start: nothing here talks to an
    # engine before it is healthy and proven to belong to this run
    for source in io.sources.values():
        await stack.enter_async_context(source)
    with io.stalls.waiting("the engines to answer /health", peer="the inference engines"):
        await wait_for_engines(io.engines, timeout_s=cfg.inference.timeout_s)
    await check_engines_belong_to_run(
        io.engines, cfg.inference.run_id, model_path=str(cfg.model.path),
        broadcasts=cfg.output_dir / "broadcasts",
    )  # fmt: skip
    teacher = await _start_teacher(cfg, stack, io.stalls)
    episode_log = EpisodeLog(cfg.output_dir)
    stack.callback(episode_log.close)
    versions = await asyncio.gather(*(e.weight_version() for e in io.engines))
    served = min(versions)
    inputs = ComponentInputs(
        source=io.sources, engines=io.engines, loader=io.loader, served_version=served, request_gate=io.gate,
        stalls=io.stalls, signal=io.signal, teacher=teacher, episode_log=episode_log, probe=io.probe,
    )  # fmt: skip
    comps = build_components(cfg, inputs)
    io.stalls.describe = functools.partial(stall_state, comps, io.sources, io.control)
    check_served_not_ahead(max(versions), comps.start_step)
    logger.info("engines serve weight version %d; first batch is step %d", served, comps.start_step)
    return comps


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


def stall_state(comps: Components, sources: Mapping[str, RolloutSource], control: Any) -> dict[str, Any]:
    """The orchestrator's part of a stall report (`utils/stall.py`): where the run is and what each
    peer last did."""
    now = time.monotonic()
    pending: dict[str, int] = {}
    heard: dict[str, float | None] = {}
    for source in sources.values():
        traffic = source.engine_traffic()
        for url, n in traffic.pending.items():
            pending[url] = pending.get(url, 0) + n
        for url, t in traffic.last_answer.items():
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


def _console_line(step: int, m: dict[str, float]) -> str:
    return (
        f"step {step} | reward {m['reward/mean']:.3f} | staleness {m['rollout/data_staleness/mean']:.2f} "
        f"(max {m['rollout/data_staleness/max']:.0f}) | inflight {m['rollout/buffer/inflight_groups']:.0f} "
        f"buffer {m['rollout/buffer/size']:.0f} dropped {m['rollout/buffer/dropped_groups']:.0f} | "
        f"step {m['time/step']:.2f}s wait {m['time/wait_data']:.2f}s sync {m['time/sync_weights']:.2f}s | "
        f"{m['rollout/tokens_per_s']:.0f} completion tok/s finished"
    )


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
