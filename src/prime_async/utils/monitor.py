"""Metric sink of a component: one JSONL file under `output_dir/metrics/` plus wandb, same names.

Only a component's main loop calls `Monitor.log`; components expose `metrics()` dicts.
wandb is imported lazily, runs offline without credentials and never needs the network.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from prime_async.config.shared import WandbConfig

logger = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


class Monitor:
    """Appends `{"step": n, "time": t, **metrics}` lines to `output_dir/metrics/<name>.jsonl` and to wandb."""

    def __init__(self, *, output_dir: Path, name: str, wandb_cfg: WandbConfig, config: dict | None = None):
        self.path = Path(output_dir) / "metrics" / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._run = (
            self._start_wandb(wandb_cfg, name, Path(output_dir), config) if wandb_cfg.enabled else None
        )

    @staticmethod
    def _start_wandb(cfg: WandbConfig, name: str, output_dir: Path, config: dict | None):
        import wandb

        mode = cfg.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        run_name = f"{cfg.name}-{name}" if cfg.name else name
        return wandb.init(
            project=cfg.project,
            group=cfg.group,
            name=run_name,
            job_type=name,
            mode=mode,
            dir=str(output_dir),
            config=config or {},
            reinit="create_new",
        )

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._run is not None:
            self._run.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._run is not None:
            self._run.finish()
            self._run = None
