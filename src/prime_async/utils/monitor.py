"""Metric sink of a component: one JSONL file under `output_dir/metrics/` plus wandb, same names.

Only a component's main loop calls `Monitor.log`; components expose `metrics()` dicts.
wandb is imported lazily, runs offline without credentials and never needs the network.

Evaluations (`log_eval`) are keyed by the weights version they ran at, not by the step at which they
finished: their lines go to `metrics/eval.jsonl` with `step` = the version, and to the same wandb run
with `eval/weight_version` as the x-axis of every `eval/*` chart (wandb steps must only increase, so the
wandb row is the component's latest step).
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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file the `Monitor` wrote (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def _cell(value: Any) -> Any:
    """A wandb table cell: a dict or list (e.g. a sample's env metrics) as its JSON text."""
    return json.dumps(value) if isinstance(value, dict | list) else _jsonable(value)


class Monitor:
    """Appends `{"step": n, "time": t, **metrics}` lines to `output_dir/metrics/<name>.jsonl` and to wandb."""

    def __init__(self, *, output_dir: Path, name: str, wandb_cfg: WandbConfig, config: dict | None = None):
        self.path = Path(output_dir) / "metrics" / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._run = (
            self._start_wandb(wandb_cfg, name, Path(output_dir), config) if wandb_cfg.enabled else None
        )
        self._eval_path = Path(output_dir) / "metrics" / "eval.jsonl"
        self._eval_file = self._file if self._eval_path == self.path else None
        self._last_step = 0

    @staticmethod
    def _start_wandb(cfg: WandbConfig, name: str, output_dir: Path, config: dict | None):
        import wandb

        mode = cfg.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        run_name = f"{cfg.name}-{name}" if cfg.name else name
        run = wandb.init(
            project=cfg.project,
            group=cfg.group,
            name=run_name,
            job_type=name,
            mode=mode,
            dir=str(output_dir),
            config=config or {},
            reinit="create_new",
        )
        run.define_metric("eval/weight_version")
        run.define_metric("eval/*", step_metric="eval/weight_version")
        return run

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._last_step = max(self._last_step, step)
        if self._run is not None:
            self._run.log(metrics, step=step)

    def log_eval(self, metrics: dict[str, Any], *, version: int) -> None:
        """An evaluation at weights `version`: `metrics/eval.jsonl` (step = version) and wandb."""
        if self._eval_file is None:
            self._eval_file = self._eval_path.open("a", buffering=1)
        values = {k: _jsonable(v) for k, v in metrics.items()}
        record = {"step": version, "time": time.time(), "eval/weight_version": version, **values}
        self._eval_file.write(json.dumps(record) + "\n")
        if self._run is not None:
            self._run.log({**metrics, "eval/weight_version": version}, step=self._last_step)

    def log_table(self, key: str, rows: list[dict[str, Any]]) -> bool:
        """Log `rows` (dicts with the same keys) as a wandb table; False when wandb is off."""
        if self._run is None or not rows:
            return False
        import wandb

        columns = list(rows[0])
        table = wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
        self._run.log({key: table}, step=self._last_step)
        return True

    def close(self) -> None:
        if self._eval_file is not None and self._eval_file is not self._file:
            self._eval_file.close()
        self._file.close()
        if self._run is not None:
            self._run.finish()
            self._run = None
