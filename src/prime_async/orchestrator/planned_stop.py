"""A planned stop of the orchestrator (SIGTERM / Ctrl-C): save everything generated, then exit 143.

    signal ──► admission held, weight watcher stopped (engines told to continue: none is left paused)
           ──► every gateway frozen: in-flight engine requests aborted, their partial output recorded
           ──► (first, in one atomic step with the batch sender: `BatchSender.stop_serving`) the batch
               stream is frozen: no batch newer than d is served by this lifetime any more
           ──► checkpoint of step d = the newest batch the trainer has fetched, whose pending groups
               are the batches cut after d (not fetched: the trainer never saw them), the buffered groups
               and the groups in flight, each with its carried work (`carry.py`); checkpoints of steps
               after d are moved aside (`.undelivered_step_<n>.json`)
           ──► PlannedStop: the process exits with EXIT_PLANNED_STOP (143, as for SIGTERM)

Why the step is the newest *fetched* batch: the trainer asks for batch d + 1 next, and the resumed
orchestrator's first batch is d + 1, so `rl` restarts the orchestrator alone (no rollback,
`launcher/restart.py`) and the trainer goes on. A batch the sender cached but no rank fetched is made
again from its groups, which are carried whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_async.orchestrator.ckpt import checkpoint_dir, save_checkpoint
from prime_async.orchestrator.types import Group

if TYPE_CHECKING:
    from prime_async.orchestrator.components import Components

logger = logging.getLogger(__name__)

EXIT_PLANNED_STOP = 143
FREEZE_TIMEOUT_S = 5.0


class PlannedStop(Exception):
    """The orchestrator was asked to stop (signal) and saved its state: exit with EXIT_PLANNED_STOP."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by the first SIGTERM or SIGINT, for the whole lifetime of the orchestrator's loop.

    Before the main loop (start-up) the stop is taken as soon as the loop starts; while it runs it is the
    planned stop; after it (teardown, waiting for the trainer to fetch the final batch) the run is ending
    anyway. A repeated signal is logged and ignored, and after the handlers are removed the signals stay
    ignored until the process exits: the default action would kill the process (-15), which `rl` takes
    for a crash and answers with a rollback instead of the restart of a planned stop
    (`launcher/restart.py`). `rl`'s own stop ends a process that does not exit with SIGKILL."""
    loop, stop = asyncio.get_running_loop(), asyncio.Event()

    def on_signal(signum: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("%s again: the orchestrator is already stopping (ignored)", signum.name)
            return
        logger.warning("%s: the orchestrator stops as planned (a repeated signal is ignored)", signum.name)
        stop.set()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield stop
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
            signal.signal(signum, _ignore_while_exiting)


def _ignore_while_exiting(signum: int, frame: object) -> None:
    logger.warning("%s: the orchestrator is exiting (ignored)", signal.Signals(signum).name)


async def stop_and_save(
    output_dir: Path,
    comps: Components,
    *,
    delivered: int,
    undelivered: dict[int, list[Group]],
    watcher_task: asyncio.Task | None,
    state: Callable[[Components, list[Group]], dict[str, Any]],
) -> Path:
    """Freeze generation and write the planned-stop checkpoint (module docstring); returns its path.
    `delivered`: newest batch step every trainer rank fetched (start_step - 1 when none in this
    lifetime); `undelivered`: the groups of each batch cut after it."""
    comps.admission.hold()
    if watcher_task is not None:
        watcher_task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(watcher_task, timeout=FREEZE_TIMEOUT_S)
    engines = comps.watcher.engines
    await asyncio.gather(*(e.continue_generation() for e in engines), return_exceptions=True)
    sources = [env.source for env in comps.envs.envs.values()]
    await asyncio.gather(*(source.freeze(FREEZE_TIMEOUT_S) for source in sources))
    cut_after = [g for step in sorted(undelivered) if step > delivered for g in undelivered[step]]
    pending = cut_after + comps.groups.pending_groups()
    _move_aside_after(output_dir, delivered)
    path = save_checkpoint(output_dir, delivered, {**state(comps, pending), "planned_stop": True})
    for source in sources:
        source.release()
    carried = sum(len(g.finished_by_index) for g in pending)
    logger.warning(
        "planned stop: checkpoint of step %d with %d pending groups (%d batches not fetched, %d finished "
        "episodes and the calls of the running ones carried over)",
        delivered, len(pending), len([s for s in undelivered if s > delivered]), carried,
    )  # fmt: skip
    return path


def _move_aside_after(output_dir: Path, step: int) -> None:
    """Checkpoints of batches the trainer never fetched would resume past them: move them aside."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return
    for name in os.listdir(root):
        if name.startswith("step_") and name.endswith(".json"):
            with contextlib.suppress(ValueError):
                if int(name[len("step_") : -len(".json")]) > step:
                    os.replace(root / name, root / f".undelivered_{name}")
