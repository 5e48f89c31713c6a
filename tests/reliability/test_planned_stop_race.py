"""A planned stop while the orchestrator is batches ahead of the trainer: the trainer never trains a batch
of the stopped lifetime newer than the planned-stop checkpoint, so no prompt is trained twice and no batch
the resumed lifetime makes again from the carried groups goes unfetched (audit 2026-12-04, F1).

Real pieces: `build_components`, `run_loop` with `stop=`, `stop_and_save`, the carry, `BatchSender` and
`BatchReceiver` over ZeroMQ. Simulated: engines and rollout sources (`prime_async.simulation`), the
trainer's compute (a thread that fetches batch n, sleeps, publishes version n + 1). The stop (the event
SIGTERM sets) arrives in the middle of a trainer step; as in `orchestrator._run`, the stopped lifetime's
sender stays open for the teardown's seconds before it closes, and the resumed lifetime binds the same
port. Each batch is tagged with its lifetime, so the test sees which lifetime's batch the trainer got.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.orchestrator.planned_stop import PlannedStop
from prime_async.orchestrator.types import Group
from prime_async.simulation import InMemoryBroadcasts, SimParams, SimulatedEngine, SimulatedRolloutSource
from prime_async.transport import zmq_batches
from prime_async.transport.types import TrainBatch
from prime_async.transport.zmq_batches import BatchReceiver, BatchSender
from prime_async.weights.loaders.filesystem import FilesystemLoader
from proc_helpers import free_port

MAX_STEPS = 7
STOP_AT = 2  # the stop arrives while the trainer trains this step
TRAIN_S = 0.3
STOP_DELAY_S = 0.15  # into that step
TEARDOWN_S = 1.0  # the stopped lifetime's sender stays open this long after the checkpoint (`_run`)
K = 2
Prompt = tuple[str, int, int]  # (env, example, epoch)


@dataclass
class World:
    """What both lifetimes share: the simulated engine and sources, the broadcasts, what was recorded."""

    engines: list[SimulatedEngine]
    sources: dict[str, SimulatedRolloutSource]
    broadcasts: InMemoryBroadcasts = field(default_factory=InMemoryBroadcasts)
    cuts: dict[tuple[int, int], list[Prompt]] = field(default_factory=dict)  # (lifetime, step) -> prompts
    received: list[tuple[int, int]] = field(default_factory=list)  # (step, lifetime) the trainer got
    errors: list[str] = field(default_factory=list)
    stop: asyncio.Event | None = None
    loop: asyncio.AbstractEventLoop | None = None


def _cfg(out: Path, port: int, *, resume: bool) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate({
        "output_dir": str(out), "max_steps": MAX_STEPS, "batch_groups": 2, "group_size": 2,
        "max_off_policy_steps": K, "data": {"ckpt": {"resume": resume}},
        "admission": {"unused_handler": "retry"},
        "inference": {"base_urls": ["sim://engine0"]}, "transport": {"port": port, "timeout_s": 30},
        "envs": [{"id": "reverse-text", "name": "a", "ratio": 2.0}, {"id": "reverse-text", "name": "b"}],
    })  # fmt: skip


async def _lifetime(cfg: OrchestratorConfig, world: World, life: int) -> tuple[bool, int]:
    """Run one orchestrator lifetime; (whether it ended in a planned stop, its start step)."""
    served = min(e.version for e in world.engines)
    comps = build_components(
        cfg,
        ComponentInputs(
            source=world.sources,
            engines=world.engines,
            loader=FilesystemLoader(world.broadcasts),
            served_version=served,
        ),
    )
    comps.watcher.poll_interval_s = 0.05
    sender = BatchSender(cfg=cfg.transport, num_ranks=1)
    world.stop, world.loop = asyncio.Event(), asyncio.get_running_loop()

    async def send_batch(batch: TrainBatch) -> None:
        batch.metrics["test/lifetime"] = float(life)  # travels in the header: the trainer sees whose
        await asyncio.to_thread(sender.send, batch)

    def on_step(step: int, groups: list[Group]) -> None:
        world.cuts[(life, step)] = sorted((g.env, g.example_id, g.epoch) for g in groups)

    stopped = False
    try:
        await run_loop(cfg, comps, send_batch=send_batch, log_metrics=lambda m, s: None, on_step=on_step,
                       stop=world.stop, delivered=sender.delivered_step,
                       stop_serving=sender.stop_serving)  # fmt: skip
        await asyncio.to_thread(sender.wait_delivered, MAX_STEPS - 1, 30)
    except PlannedStop:
        stopped = True
        await asyncio.sleep(TEARDOWN_S)  # `_run`: _shutdown and the sources' stop, then sender.close()
    finally:
        sender.close()
    return stopped, comps.start_step


def _trainer(cfg: OrchestratorConfig, world: World) -> None:
    """Fetch batches 0..MAX_STEPS-1 in order; set the stop event STOP_DELAY_S into step STOP_AT."""
    rx = BatchReceiver(cfg=cfg.transport, rank=0, world_size=1)
    try:
        for step in range(MAX_STEPS):
            batch = rx.receive(step, timeout=30)
            world.received.append((step, int(batch.metrics["test/lifetime"])))
            if step == STOP_AT and len(world.received) == STOP_AT + 1:
                time.sleep(STOP_DELAY_S)
                world.loop.call_soon_threadsafe(world.stop.set)
                time.sleep(TRAIN_S - STOP_DELAY_S)
            else:
                time.sleep(TRAIN_S)
            world.broadcasts.latest = step + 1
    except Exception as exc:  # reported by the test
        world.errors.append(repr(exc))
    finally:
        rx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [3, 4, 6])
def test_planned_stop_trains_every_prompt_once(seed: int, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(zmq_batches, "ASK_AGAIN_S", 0.3)  # the trainer finds the resumed lifetime sooner
    params = SimParams(num_engines=1, latency_s=0.02, pareto_alpha=3.0, max_latency_s=0.2, update_time_s=0.01)
    rng = random.Random(seed)
    engines = [SimulatedEngine(index=0, params=params, rng=rng)]
    port = free_port()
    cfg1, cfg2 = _cfg(tmp_path, port, resume=False), _cfg(tmp_path, port, resume=True)
    sources = {e.label: SimulatedRolloutSource(engines=engines, params=params, rng=rng) for e in cfg1.envs}
    world = World(engines=engines, sources=sources)
    trainer = threading.Thread(target=_trainer, args=(cfg1, world), daemon=True)

    async def both() -> tuple[tuple[bool, int], tuple[bool, int]]:
        trainer.start()
        first = await _lifetime(cfg1, world, life=1)
        return first, await _lifetime(cfg2, world, life=2)

    (stopped1, _), (stopped2, start2) = asyncio.run(both())
    trainer.join(30)
    assert not world.errors, world.errors
    assert stopped1 and not stopped2
    ckdir = tmp_path / "checkpoints" / "orchestrator"
    saved = json.loads(max(ckdir.glob("step_*.json"), key=lambda p: int(p.stem[5:])).read_text())
    d = saved["step"]
    assert saved["planned_stop"] and start2 == d + 1
    cut_ahead = [s for (life, s) in world.cuts if life == 1 and s > d]
    assert cut_ahead, f"lifetime 1 cut nothing past the checkpoint of step {d}: the race was not armed"

    # the trainer's side: every step once, from lifetime 1 up to the checkpoint, from lifetime 2 after it
    assert [s for s, _ in world.received] == list(range(MAX_STEPS)), world.received
    wrong = [(s, life) for s, life in world.received if life != (1 if s <= d else 2)]
    assert not wrong, f"checkpoint of step {d}; (step, lifetime) received from the wrong lifetime: {wrong}"

    # the prompts: none trained twice; every batch lifetime 2 made again from the carried groups received
    trained: dict[Prompt, list[int]] = {}
    for s, life in world.received:
        for prompt in world.cuts[(life, s)]:
            trained.setdefault(prompt, []).append(s)
    twice = {p: steps for p, steps in trained.items() if len(steps) > 1}
    assert not twice, f"prompts trained more than once: {twice}"
    carried = {p for s in cut_ahead for p in world.cuts[(1, s)]}
    assert carried <= set(trained), f"carried prompts never trained: {carried - set(trained)}"
