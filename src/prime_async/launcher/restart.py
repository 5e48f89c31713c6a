"""Restart policy of the `rl` launcher: which dead component comes back, and with which config.

    inference dies (any exit: it must outlive the run)
        -> model.path = output_dir/broadcasts/step_N (newest N with STABLE), weight_version = N
           (no broadcast yet: the original config, v0); the trainer's history is unchanged
    teacher_inference (the distillation teacher's engine) dies
        -> it restarts with its original config (the teacher's weights never change); the orchestrator
           holds scoring meanwhile (`rollouts/teacher.py`, up to teacher.outage_timeout_s)
    orchestrator stopped as planned (exit 143 after a planned-stop checkpoint, `weights.transport =
    "filesystem"`)
        -> it alone restarts with data.ckpt.resume = true: its checkpoint is the newest batch the
           trainer fetched, with the work in flight carried over; the trainer waits for the next batch,
           the engines keep their weights (no rollback, nothing generated or trained is lost)
    trainer or orchestrator dies (non-zero, any other way)
        -> the run ROLLS BACK to the trainer's newest complete checkpoint c (0 without one):
           1. the other of the two is stopped too;
           2. orchestrator checkpoints of steps >= c are moved aside (`.ahead_step_n.json`), so the
              orchestrator resumes from its checkpoint of step c-1 (batch c is the next one of both);
           3. broadcasts of versions > c are discarded (they belong to the abandoned history);
           4. every engine loads version c (`broadcasts/step_c`, or the initial model for c = 0),
              labelled c, with its cache flushed and requests aborted;
           5. trainer and orchestrator restart with ckpt.resume / data.ckpt.resume = true (when they
              have a checkpoint).

Why both: after a trainer death the orchestrator has produced batches and loaded weights the restarted
trainer will make again, slightly differently; keeping them would train on weights of a history that no
longer exists (negative staleness, `n - d < 0`). Rolling both back costs at most one checkpoint interval of
generation and needs no resend buffer. `config/rl.py` makes the orchestrator checkpoint on the trainer's
checkpoint steps (step 2 relies on it).

Each restart writes `configs/<name>.restart<k>.toml` (the resolved sub-config plus the overrides) and
starts the component from that file, so the logs and configs of a run say exactly what ran.

Invariants:
- a broadcast directory is used only when its `STABLE` marker exists (never a partial write);
- after any restart, every engine serves exactly the version the trainer resumes from (`roll_back`);
- every component has its own budget of `restart.max_restarts`; a death past the budget fails the run;
- without trainer checkpoints a rollback starts the run over from step 0 (warned at start).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_async.config.dicts import deep_merge
from prime_async.config.rl import RLConfig
from prime_async.weights.broadcasts import (
    broadcasts_root,
    discard_after,
    is_stable,
    latest_stable,
    version_dir,
)

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
RESTARTABLE = ("inference", "teacher_inference", "trainer", "orchestrator")


def latest_stable_broadcast(output_dir: Path) -> int | None:
    """Newest N with `output_dir/broadcasts/step_N/STABLE`, or None."""
    return latest_stable(broadcasts_root(output_dir))


def restart_overrides(cfg: RLConfig, name: str) -> dict[str, Any]:
    """Changes to the sub-config `name` for its restart; raises ValueError when it cannot restart."""
    if name == "inference":
        version = latest_stable_broadcast(Path(cfg.output_dir))
        if version is None:
            return {}
        path = Path(cfg.output_dir) / "broadcasts" / f"step_{version}"
        return {"model": {"path": str(path)}, "weight_version": version}
    if name == "teacher_inference":
        return {}
    if name == "trainer":
        resume = {"ckpt": {"resume": True}}
        return resume if trainer_checkpoint_step(Path(cfg.output_dir)) is not None else {}
    if name == "orchestrator":
        return {"data": {"ckpt": {"resume": True}}}
    raise ValueError(f"{name} is not restartable")


PLANNED_STOP_EXIT = 143


def orchestrator_stopped_as_planned(cfg: RLConfig, returncode: int | None) -> bool:
    """The orchestrator exited after a planned stop whose checkpoint the trainer can continue from
    (module docstring). Distributed weights roll back: their handshake is not resumable mid-run."""
    if returncode != PLANNED_STOP_EXIT or cfg.orchestrator.weights.transport != "filesystem":
        return False
    from prime_async.orchestrator.ckpt import latest_checkpoint

    state = latest_checkpoint(Path(cfg.output_dir))
    return bool(state and state.get("planned_stop"))


def trainer_checkpoint_step(output_dir: Path) -> int | None:
    """Newest complete trainer checkpoint (`checkpoints/trainer/step_N/COMPLETE`), or None."""
    root = Path(output_dir) / "checkpoints" / "trainer"
    steps = [
        int(m.group(1))
        for p in (root.iterdir() if root.is_dir() else [])
        if (m := _STEP_DIR.match(p.name)) and (p / "COMPLETE").is_file()
    ]
    return max(steps) if steps else None


def align_orchestrator_checkpoints(output_dir: Path, trainer_step: int) -> list[int]:
    """Move orchestrator checkpoints of steps >= `trainer_step` aside; returns the moved steps."""
    root = Path(output_dir) / "checkpoints" / "orchestrator"
    moved = []
    for path in sorted(root.glob("step_*.json")) if root.is_dir() else []:
        step = int(path.stem[len("step_") :])
        if step >= trainer_step:
            path.rename(path.with_name(f".ahead_{path.name}"))
            moved.append(step)
    return sorted(moved)


@dataclass(frozen=True)
class Rollback:
    """What `roll_back` did: the step both resume at, and what it moved aside or discarded."""

    step: int
    moved_orchestrator_checkpoints: list[int]
    discarded_versions: list[int]


def roll_back(cfg: RLConfig) -> Rollback:
    """Steps 2-4 of the module docstring (trainer and orchestrator are already stopped)."""
    output_dir = Path(cfg.output_dir)
    step = trainer_checkpoint_step(output_dir) or 0
    moved = align_orchestrator_checkpoints(output_dir, step)
    discarded = discard_after(broadcasts_root(output_dir), step)
    if step == 0:
        path = str(cfg.inference.model.path)
    else:
        path = str(version_dir(broadcasts_root(output_dir), step))
        if not is_stable(broadcasts_root(output_dir), step):
            raise RuntimeError(f"cannot roll back to step {step}: {path} has no STABLE weights")
    asyncio.run(_load_everywhere(cfg, path, step))
    return Rollback(step, moved, discarded)


async def _load_everywhere(cfg: RLConfig, path: str, version: int) -> None:
    from prime_async.inference.client import HttpEngineClient

    for url in cfg.orchestrator.inference.base_urls:
        async with HttpEngineClient(url, cfg.inference.server.api_key) as engine:
            # the dead orchestrator may have left the engine paused or busy with requests nobody awaits
            await engine.abort_request(abort_all=True)
            await engine.continue_generation()
            await engine.update_weights_from_disk(path, version, flush_cache=True, abort_all_requests=True)
            served = await engine.weight_version()
        if served != version:
            raise RuntimeError(f"engine {url} reports version {served} after loading version {version}")
        logger.info("engine %s now serves version %d (%s)", url, version, path)


def write_restart_config(base_path: Path, overrides: dict[str, Any], attempt: int) -> Path:
    """`<name>.restart<attempt>.toml` next to `base_path`: the base config with `overrides` applied."""
    import tomllib

    import tomli_w

    data = deep_merge(tomllib.loads(base_path.read_text()), overrides)
    path = base_path.with_name(f"{base_path.stem}.restart{attempt}.toml")
    path.write_text(tomli_w.dumps(data))
    return path


@dataclass
class RestartBudget:
    """Restarts done so far per component, against `max_restarts` each."""

    max_restarts: int
    used: dict[str, int] = field(default_factory=dict)

    def allows(self, name: str) -> bool:
        return name in RESTARTABLE and self.used.get(name, 0) < self.max_restarts

    def take(self, name: str) -> int:
        self.used[name] = self.used.get(name, 0) + 1
        return self.used[name]
