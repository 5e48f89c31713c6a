"""Restart policy of the `rl` launcher: which dead component comes back, and with which config.

    inference dies (any exit: it must outlive the run)
        -> model.path = output_dir/broadcasts/step_N (newest N with STABLE), weight_version = N
           (no broadcast yet: the original config, v0)
    trainer dies (non-zero)      -> resume = true   (continues from its newest complete checkpoint)
    orchestrator dies (non-zero) -> trainer stopped too; orchestrator checkpoints of steps >= the trainer's
                                    newest checkpoint c are moved aside (`.ahead_step_n.json`); both
                                    restart with resume = true, so batch c is the next one of both

Each restart writes `configs/<name>.restart<k>.toml` (the resolved sub-config plus the overrides) and
starts the component from that file, so the logs and configs of a run say exactly what ran.

Invariants:
- a broadcast directory is used only when its `STABLE` marker exists (never a partial write);
- every component has its own budget of `restart.max_restarts`; a death past the budget fails the run;
- a trainer is restarted only when it writes checkpoints (`ckpt.interval`); it resumes when one exists;
- after an orchestrator restart no prompt is skipped or trained twice by the surviving lineage of weights,
  provided `orchestrator.ckpt.interval` divides `trainer.ckpt.interval` (then a checkpoint of step c-1
  exists; otherwise the orchestrator resumes earlier and the batches before c are produced unused).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
RESTARTABLE = ("inference", "trainer", "orchestrator")


def latest_stable_broadcast(output_dir: Path) -> int | None:
    """Newest N with `output_dir/broadcasts/step_N/STABLE`, or None."""
    root = Path(output_dir) / "broadcasts"
    try:
        names = [p.name for p in root.iterdir()]
    except FileNotFoundError:
        return None
    versions = sorted((int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))), reverse=True)
    for version in versions:
        if (root / f"step_{version}" / "STABLE").is_file():
            return version
    return None


def restart_overrides(cfg: Any, name: str) -> dict[str, Any]:
    """Changes to the sub-config `name` for its restart; raises ValueError when it cannot restart."""
    if name == "inference":
        version = latest_stable_broadcast(Path(cfg.output_dir))
        if version is None:
            return {}
        path = Path(cfg.output_dir) / "broadcasts" / f"step_{version}"
        return {"model": {"path": str(path)}, "weight_version": version}
    if name == "trainer":
        if getattr(cfg.trainer.ckpt, "interval", None) is None:
            raise ValueError("trainer.ckpt.interval is not set: a restarted trainer has nothing to resume")
        return {"resume": True} if trainer_checkpoint_step(Path(cfg.output_dir)) is not None else {}
    if name == "orchestrator":
        return {"resume": True}
    raise ValueError(f"{name} is not restartable")


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


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def write_restart_config(base_path: Path, overrides: dict[str, Any], attempt: int) -> Path:
    """`<name>.restart<attempt>.toml` next to `base_path`: the base config with `overrides` applied."""
    import tomllib

    import tomli_w

    data = _merge(tomllib.loads(base_path.read_text()), overrides)
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
