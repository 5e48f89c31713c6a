"""Orchestrator checkpoints: `output_dir/checkpoints/orchestrator/step_<n>.json`.

A checkpoint of step n is taken right after batch n was handed to the transport, in one synchronous
piece of the event loop (no await), so the data-source position and the set of prompts issued but not
trained (in the sink or in flight) are consistent. On resume those prompts are issued first again.
Writes are atomic (temp file + rename); `latest_checkpoint` ignores anything else.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(-?\d+)\.json$")  # step -1: a planned stop before the first batch


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints" / "orchestrator"


def save_checkpoint(output_dir: Path, step: int, state: dict[str, Any]) -> Path:
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"step_{step}.json"
    tmp = root / f".step_{step}.json.tmp"
    tmp.write_text(json.dumps({"step": step, **state}))
    os.replace(tmp, path)
    logger.info("orchestrator checkpoint step %d -> %s", step, path)
    return path


def latest_checkpoint(output_dir: Path) -> dict[str, Any] | None:
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for n in os.listdir(root) if (m := _NAME.match(n))]
    if not steps:
        return None
    return json.loads((root / f"step_{max(steps)}.json").read_text())
