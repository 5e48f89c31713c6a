"""The orchestrator's main loop over the built components (`components.py`); the process's entry and
composition root is `main.py`. No component imports this.

    EnvMix (schedule, DataSource per env) ─► Dispatcher ─(Admission)─► RolloutSource of the group's env
                                                        (verifiers env ─► gateway ─► engines)
                      │  finished groups                                        ▲
                      ▼                                                         │ pause / update / resume
                  TrainSink ── get_batch(n): sweep vs K, take oldest ─► build_train_batch ─► BatchSender
                                                                                │ (ZMQ, pull by trainer)
    trainer ── broadcasts/step_N/STABLE ──► WeightWatcher ───────────────────────┘
            ── Published(N) (control channel) ──► wakes it; its WeightLoader (weights/loaders/) loads N

Main loop, step n: wait for batch n from the sink (backpressure point: the trainer pulls batches, and
admission stops dispatch when `next_batch_step - served_version > K`), cut it (the group table moves the
groups to trained, admission re-checks, unshippable in-flight groups are cancelled), checkpoint (before
the batch can reach the trainer), send it, check the group table, log metrics.

A planned stop (`stop` set) freezes generation and checkpoints everything generated, in flight included
(`planned_stop.py`); a resume carries that work over (`carry.py`).
Background tasks (dispatcher, weight watcher, in-run eval) are supervised: a failure of any ends the main
loop with that exception; shutdown cancels them with a timeout. With an eval configured, the loop holds
admission after the last batch (no new training group) and waits for the final version's eval
(`eval/in_run.py`); eval episodes never enter the group table.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.eval.in_run import InRunEval
from prime_async.health.watch import health_inputs
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.carry import snapshot
from prime_async.orchestrator.ckpt import save_checkpoint
from prime_async.orchestrator.components import Components
from prime_async.orchestrator.dispatcher import episode_key
from prime_async.orchestrator.metrics import batch_metrics
from prime_async.orchestrator.planned_stop import PlannedStop, stop_and_save
from prime_async.orchestrator.types import Group
from prime_async.transport.types import TrainBatch
from prime_async.utils.stall import StallWatch, waiting

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


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
    return comps.envs.get(group.env).source.recorded_calls(episode_key(group, index))


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
            num_ranks=cfg.batch.packing.num_train_ranks,
            temperature=cfg.sampling.temperature,
            advantage_cfg=cfg.batch.advantage,
            share_prefix=cfg.batch.packing.share_prompt_prefix,
            teacher=cfg.teacher,
            max_off_policy_steps=cfg.max_off_policy_steps,
        )
        batch.metrics["batch/lifetime_start"] = float(comps.start_step)  # whose batch the trainer trains
        batch.metrics.update(health_inputs(batch_metrics(groups, step, list(comps.envs.envs))))  # health/
        comps.length_bias.trained(groups)
        comps.undelivered[step] = groups  # until the trainer fetched it: a planned stop carries them
        if on_step is not None:
            on_step(step, groups)
        # Checkpoint before the batch can reach the trainer: a death between the two must never leave
        # a trainer checkpoint of step + 1 without the orchestrator's of `step` (the rollback would
        # resume the orchestrator behind engines serving step + 1, and die again, until the restart
        # budget is gone). The state is final here: the cut moved the batch's groups to trained.
        if cfg.data.ckpt.interval is not None and (step + 1) % cfg.data.ckpt.interval == 0:
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
            metrics.update(await comps.engine_load.metrics())
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


def _step_metrics(
    comps: Components, groups: list[Group], step: int, *, time_step: float, wait_data: float
) -> dict[str, float]:
    metrics = batch_metrics(groups, step, list(comps.envs.envs), comps.groups.max_off_policy_steps)
    metrics.update(comps.envs.metrics())
    metrics.update(comps.groups.metrics())
    metrics.update(comps.sink.metrics())
    metrics.update(comps.admission.metrics())
    metrics.update(comps.dispatcher.metrics())
    metrics.update(comps.watcher.metrics())
    if comps.teacher is not None:
        metrics.update(comps.teacher.metrics())
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
