"""Stall reports: no run waits silently.

    component code:  with stalls.waiting("batch 7", peer="trainer"):  ...the wait...
    watchdog thread: a wait older than `stall_after_s` ──► one ERROR line + output_dir/stall.json
                     (who waits on whom: component, what, peer, since when, and the component's own
                     state from `describe()`: step, version, pending requests per engine, when each
                     peer was last heard from); when the wait ends, an INFO line and `resolved_after_s`

Used by the orchestrator (batch wait, batch delivery, weight updates, eval, final drain) and the trainer
(batch wait, weight writes and transfers). The watchdog is a thread, so a blocked event loop is reported
too.

Invariants: reporting never changes what the run does (the waits keep their own timeouts, the restart
policy decides failure); each wait is reported at most once (and once more when it ends);
`stall.json` is written atomically (temp file + rename) and holds the newest report of any component,
`stall-<component>.json` each one's newest, `stalls.jsonl` every report of the run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.25


@dataclass
class Wait:
    """One wait of this component on a peer."""

    what: str
    peer: str | Callable[[], str]  # a callable is asked at report time (the peer can change meanwhile)
    since: float  # time.monotonic()
    started_at: float  # time.time()
    reported: bool = False


@dataclass
class StallWatch:
    """Registry of the component's current waits plus the watchdog thread that reports old ones."""

    component: str
    output_dir: Path
    stall_after_s: float
    describe: Callable[[], dict[str, Any]] = dict
    _waits: dict[int, Wait] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    num_stalls: int = 0

    @contextlib.contextmanager
    def waiting(self, what: str, *, peer: str | Callable[[], str]) -> Iterator[None]:
        """Register a wait of this component on `peer` for the duration of the block."""
        key = next(self._ids)
        with self._lock:
            self._waits[key] = Wait(what, peer, time.monotonic(), time.time())
        try:
            yield
        finally:
            with self._lock:
                wait = self._waits.pop(key)
            if wait.reported:
                took = time.monotonic() - wait.since
                logger.info(
                    "stall over: %s waited %.1f s on %s for %s", self.component, took, _name(peer), what
                )
                self._write(wait, resolved_after_s=took)

    def start(self) -> StallWatch:
        self._thread = threading.Thread(target=self._watch, name=f"stall-watch-{self.component}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                due = [
                    w for w in self._waits.values() if not w.reported and now - w.since > self.stall_after_s
                ]
                for wait in due:
                    wait.reported = True
            for wait in due:
                self._report(wait, now - wait.since)

    def _report(self, wait: Wait, waited: float) -> None:
        self.num_stalls += 1
        logger.error(
            "stall: %s has waited %.0f s (log.stall_after_s = %.0f) on %s for %s; details in %s",
            self.component, waited, self.stall_after_s, _name(wait.peer), wait.what,
            self.output_dir / "stall.json",
        )  # fmt: skip
        self._write(wait)

    def _write(self, wait: Wait, *, resolved_after_s: float | None = None) -> None:
        try:
            state = self.describe()
        except Exception as e:  # tolerated: a report without the component's state is still a report
            state = {"describe_error": f"{type(e).__name__}: {e}"}
        report = {
            "component": self.component, "waits_on": _name(wait.peer), "for": wait.what,
            "since": wait.started_at, "waited_s": round(time.monotonic() - wait.since, 3),
            "stall_after_s": self.stall_after_s, "resolved_after_s": resolved_after_s,
            "pid": os.getpid(), "state": state,
        }  # fmt: skip
        text = json.dumps(report, indent=2, default=str)
        for name in ("stall.json", f"stall-{self.component}.json"):
            _write_atomic(self.output_dir / name, text)
        with contextlib.suppress(OSError), (self.output_dir / "stalls.jsonl").open("a") as f:
            f.write(json.dumps(report, default=str) + "\n")  # one short append: atomic between processes


def _name(peer: str | Callable[[], str]) -> str:
    if isinstance(peer, str):
        return peer
    try:
        return peer()
    except Exception as e:  # tolerated: the report still names the wait
        return f"(peer unknown: {type(e).__name__}: {e})"


def waiting(stalls: StallWatch | None, what: str, *, peer: str | Callable[[], str]) -> Any:
    """`stalls.waiting(...)`, or a no-op context without a watch (tests, simulations)."""
    return contextlib.nullcontext() if stalls is None else stalls.waiting(what, peer=peer)


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:  # tolerated: the ERROR line already told the user
        logger.exception("could not write %s", path)
