"""Stall reports: no run waits silently.

    component code:  with stalls.waiting("batch 7", peer="trainer"):  ...the wait...
    watchdog thread: a wait older than `stall_after_s` ──► one ERROR line + output_dir/stall.json
                     (who waits on whom: component, what, peer, since when, and the component's own
                     state from `describe()`: step, version, pending requests per engine, when each
                     peer was last heard from); when the wait ends, an INFO line naming the wait as
                     reported, and the same record with its `resolution` appended (when, after how
                     long, what ended it, whom it waited on by then and the state then)

Used by the orchestrator (batch wait, batch delivery, weight updates, eval, final drain) and the trainer
(batch wait, weight writes and transfers). The watchdog is a thread, so a blocked event loop is reported
too.

Invariants: reporting never changes what the run does (the waits keep their own timeouts, the restart
policy decides failure); each wait is reported at most once (and resolved once when it ends, by whichever
of the wait and the watchdog finishes last); a resolution keeps every reported field as reported (a
peer named by a callable can name someone else by the end: that goes to `resolution.waits_on_at_end`);
`stall.json` is written atomically (temp file + rename) and holds the newest report of any component,
`stall-<component>.json` each one's newest, `stalls.jsonl` every report and resolution of the run; a
resolution rewrites `stall.json` / `stall-<component>.json` only while they still hold its own report
(`wait_id`), so it never hides a newer stall (best effort between processes: read, then replace).
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
    key: int = -1
    reported: bool = False  # the watchdog took it (its record may still be being written)
    record: dict[str, Any] | None = None  # the report as written
    ended: dict[str, Any] | None = None  # the wait's end: at (time.time()), after_s, ended_by, waits_on


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
        wait = Wait(what, peer, time.monotonic(), time.time(), next(self._ids))
        with self._lock:
            self._waits[wait.key] = wait
        ended_by = "the wait returned"
        try:
            yield
        except BaseException as e:
            ended_by = f"{type(e).__name__}: {e}"[:300]
            raise
        finally:
            ended = {
                "at": time.time(),
                "after_s": round(time.monotonic() - wait.since, 3),
                "ended_by": ended_by,
            }
            if wait.reported:  # whom a changing peer names now (the record keeps whom it named then)
                ended["waits_on_at_end"] = _name(peer)
            with self._lock:
                self._waits.pop(wait.key)
                wait.ended = ended
                resolve = wait.record is not None  # else the watchdog is writing it and resolves it then
            if resolve:
                self._resolve(wait)

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
        record = self._record(wait)
        logger.error(
            "stall: %s has waited %.0f s (log.stall_after_s = %.0f) on %s for %s; details in %s",
            self.component, waited, self.stall_after_s, record["waits_on"], wait.what,
            self.output_dir / "stall.json",
        )  # fmt: skip
        self._write(record)
        with self._lock:
            wait.record = record
            resolve = wait.ended is not None  # the wait ended while this report was written
        if resolve:
            self._resolve(wait)

    def _record(self, wait: Wait) -> dict[str, Any]:
        """The report of `wait` now: who waits on whom for what, since when, and this component's state."""
        return {
            "component": self.component, "waits_on": _name(wait.peer), "for": wait.what,
            "since": wait.started_at, "waited_s": round(time.monotonic() - wait.since, 3),
            "stall_after_s": self.stall_after_s, "resolved_after_s": None,
            "wait_id": f"{self.component}:{os.getpid()}:{wait.key}", "pid": os.getpid(),
            "state": self._state(),
        }  # fmt: skip

    def _resolve(self, wait: Wait) -> None:
        """The INFO line and the reported record with its resolution appended (module invariants)."""
        assert wait.record is not None and wait.ended is not None
        record, ended = wait.record, {**wait.ended, "state_at_end": self._state()}
        logger.info(
            "stall over: %s waited %.1f s on %s for %s (reported after %.0f s; ended by: %s%s)",
            self.component, ended["after_s"], record["waits_on"], record["for"], record["waited_s"],
            ended["ended_by"], _changed_peer(record["waits_on"], ended.get("waits_on_at_end")),
        )  # fmt: skip
        resolved = {**record, "resolved_after_s": ended["after_s"], "resolution": ended}
        text = json.dumps(resolved, indent=2, default=str)
        for name in ("stall.json", f"stall-{self.component}.json"):
            if _holds(self.output_dir / name, record["wait_id"]):
                _write_atomic(self.output_dir / name, text)
        self._append(resolved)

    def _state(self) -> dict[str, Any]:
        try:
            return self.describe()
        except Exception as e:  # tolerated: a report without the component's state is still a report
            return {"describe_error": f"{type(e).__name__}: {e}"}

    def _write(self, record: dict[str, Any]) -> None:
        text = json.dumps(record, indent=2, default=str)
        for name in ("stall.json", f"stall-{self.component}.json"):
            _write_atomic(self.output_dir / name, text)
        self._append(record)

    def _append(self, record: dict[str, Any]) -> None:
        with contextlib.suppress(OSError), (self.output_dir / "stalls.jsonl").open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")  # one short append: atomic between processes


def _changed_peer(reported: str, at_end: str | None) -> str:
    return "" if at_end is None or at_end == reported else f"; by then it waited on {at_end}"


def _holds(path: Path, wait_id: str) -> bool:
    """`path` holds the report of `wait_id` (a missing or unreadable file holds none)."""
    try:
        return json.loads(path.read_text()).get("wait_id") == wait_id
    except (OSError, ValueError, AttributeError):
        return False


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
