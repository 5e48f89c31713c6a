"""Console progress of an `rl` run, read from the components' metrics JSONL files.

One line per orchestrator step: step, reward, staleness, trainer loss / mismatch KL, rollout and train
tokens/s (each says what it counts), ETA; and once an episode outgrew `seq_len`, the overflow count
of every env that has one (`env/<name>/overflow_episodes`, cumulative), with what it grew by since the
previous line (`overflow guess +3 (12 in all)`).
It reads files the components append to, so it never slows them down.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
_OVERFLOW = re.compile(r"^env/([^/]+)/overflow_episodes$")  # per env; `env/overflow_episodes` sums them


class JsonlFollower:
    """Yields the records appended to a JSONL file since the last call (partial lines wait)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete, _, _ = data.rpartition(b"\n")
        if not complete:
            return []
        self._offset += len(complete) + 1
        return [json.loads(line) for line in complete.split(b"\n") if line.strip()]


class ProgressView:
    """Prints one concise line per step, once both orchestrator and trainer have logged it."""

    def __init__(self, *, metrics_dir: Path, max_steps: int):
        self.max_steps = max_steps
        self._orchestrator = JsonlFollower(metrics_dir / "orchestrator.jsonl")
        self._trainer = JsonlFollower(metrics_dir / "trainer.jsonl")
        self._trainer_by_step: dict[int, dict[str, Any]] = {}
        self._pending: list[dict[str, Any]] = []
        self._started = time.monotonic()
        self._steps_done = 0
        self._overflow: dict[str, float] = {}  # env -> overflow episodes at the previous line

    def poll(self) -> None:
        for record in self._trainer.new_records():
            self._trainer_by_step[int(record["step"])] = record
        self._pending.extend(self._orchestrator.new_records())
        # A step is shown once the trainer has trained it too (its batch is cut before it is trained).
        while self._pending and int(self._pending[0]["step"]) in self._trainer_by_step:
            record = self._pending.pop(0)
            self._print(record, self._trainer_by_step.pop(int(record["step"])))

    def _print(self, orch: dict[str, Any], train: dict[str, Any]) -> None:
        self._steps_done = max(self._steps_done, int(orch["step"]) + 1)
        elapsed = time.monotonic() - self._started
        remaining = max(self.max_steps - self._steps_done, 0)
        eta = elapsed / max(self._steps_done, 1) * remaining
        parts = [
            f"step {orch['step']:>4}/{self.max_steps}",
            f"reward {_fmt(orch.get('reward/mean'))}",
            f"staleness {_fmt(orch.get('rollout/data_staleness/mean'))}"
            f"/{_fmt(orch.get('rollout/data_staleness/max'))}",
            f"loss {_fmt(train.get('loss/total'))}",
            f"mismatch_kl {_fmt(train.get('mismatch_kl'), 4)}",
            # rollout: completion tokens of the episodes that finished since the last step, per wall-clock
            # second (waits for the trainer included, so below the engines' decode rate); train: episode
            # tokens trained per second of its forward/backward/optimizer step (a shared prompt counted
            # once per episode, so sharing shows as speed)
            f"rollout {_fmt(orch.get('rollout/tokens_per_s'), 0)} tok/s",
            f"train {_fmt(train.get('perf/sample_tokens_per_s', train.get('perf/tokens_per_s')), 0)} tok/s",
            f"ETA {eta:5.0f}s",
        ]
        if overflow := self._overflow_part(orch):
            parts.append(overflow)
        logger.info(" | ".join(parts))

    def _overflow_part(self, orch: dict[str, Any]) -> str:
        """`overflow <env> +<new> (<total> in all)` per env with overflow episodes; "" while there is none."""
        out = []
        for key, value in sorted(orch.items()):
            match = _OVERFLOW.match(key)
            if match is None or not value:
                continue
            env = match[1]
            new = float(value) - self._overflow.get(env, 0.0)
            self._overflow[env] = float(value)
            out.append(
                f"{env} +{new:.0f} ({float(value):.0f} in all)" if new else f"{env} {float(value):.0f}"
            )
        return f"overflow {', '.join(out)}" if out else ""

    def finish(self) -> None:
        for record in self._pending:
            self._print(record, self._trainer_by_step.get(int(record["step"]), {}))
        self._pending.clear()
        logger.info("done: %d steps in %.1f s", self._steps_done, time.monotonic() - self._started)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{float(value):.{digits}f}"
