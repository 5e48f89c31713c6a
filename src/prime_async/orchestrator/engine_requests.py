"""The elastic engine pool's control files: how `rl-engines` asks a running orchestrator to add or remove
an engine, and how the answer comes back (`docs/elastic.md`).

    output_dir/engines/requests/<id>.json   {"op": "add" | "remove", "url", "api_key", "timeout_s"}
    output_dir/engines/results/<id>.json    {"ok", "message", "engines": [url, ...]}
    output_dir/engines/live.json            {"engines": [url, ...], "served_version"}: while an
                                            orchestrator runs (written at its start, removed at its end)
    output_dir/engines/membership.json      {"run_id", "added": {url: api_key}, "removed": [url]}: the
                                            changes made so far, made again by a restarted orchestrator

Invariants: every file is written under a temporary name and renamed into place, so a reader never sees
half a file; a request is answered by exactly one result of the same id and then deleted; files are
owner-only (a request may carry an API key); a malformed request is answered with one line naming the
problem and never raises in the orchestrator.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Op = Literal["add", "remove"]
OPS: tuple[Op, ...] = ("add", "remove")
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class EngineRequest:
    """One asked change: `op` the engine at `url` (`api_key`: its bearer token, None = the run's);
    `timeout_s` bounds the orchestrator's work on it (the join checks and load, or the drain)."""

    op: Op
    url: str
    api_key: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @staticmethod
    def parse(data: Any) -> EngineRequest:
        """A request from its JSON; ValueError (one line) when a field is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"an engine request is a JSON object, got {type(data).__name__}")
        op, url = data.get("op"), data.get("url")
        if op not in OPS:
            raise ValueError(f"engine request op {op!r} is not one of {', '.join(OPS)}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"engine request url {url!r} is not an http(s) URL")
        timeout = data.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"engine request timeout_s {timeout!r} is not a positive number")
        key = data.get("api_key")
        return EngineRequest(op, url.rstrip("/"), key if isinstance(key, str) else None, float(timeout))


@dataclass(frozen=True)
class EngineResult:
    """The answer to one request: `ok`, one line saying what happened, the engines serving after it."""

    ok: bool
    message: str
    engines: tuple[str, ...] = ()


def engines_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "engines"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` at `path`, atomically (a temporary name renamed into place), owner-only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def submit(output_dir: Path, request: EngineRequest) -> str:
    """Write `request` for the orchestrator of the run at `output_dir`; returns its id."""
    rid = f"{time.time_ns()}-{os.getpid()}"
    data = {"op": request.op, "url": request.url, "api_key": request.api_key, "timeout_s": request.timeout_s}
    write_json(engines_dir(output_dir) / "requests" / f"{rid}.json", data)
    return rid


def pending(output_dir: Path) -> list[tuple[str, EngineRequest | ValueError]]:
    """The requests not answered yet, oldest first: each parsed, or the ValueError that refuses it."""
    out: list[tuple[str, EngineRequest | ValueError]] = []
    for path in sorted((engines_dir(output_dir) / "requests").glob("[!.]*.json")):
        try:
            out.append((path.stem, EngineRequest.parse(json.loads(path.read_text()))))
        except json.JSONDecodeError as e:
            out.append((path.stem, ValueError(f"engine request {path.name} is not JSON: {e}")))
        except ValueError as e:
            out.append((path.stem, e))
    return out


def answer(output_dir: Path, rid: str, result: EngineResult) -> None:
    """Write the result of request `rid`, then delete the request."""
    data = {"ok": result.ok, "message": result.message, "engines": list(result.engines)}
    write_json(engines_dir(output_dir) / "results" / f"{rid}.json", data)
    (engines_dir(output_dir) / "requests" / f"{rid}.json").unlink(missing_ok=True)


def wait_result(output_dir: Path, rid: str, timeout_s: float, poll_s: float = 0.2) -> EngineResult | None:
    """The result of request `rid` once written, or None after `timeout_s` (no orchestrator answered)."""
    path = engines_dir(output_dir) / "results" / f"{rid}.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
    data = json.loads(path.read_text())
    return EngineResult(bool(data["ok"]), str(data["message"]), tuple(data.get("engines") or ()))


def write_live(output_dir: Path, urls: list[str], served_version: int) -> None:
    """The engines serving now (written at start and after every change)."""
    write_json(engines_dir(output_dir) / "live.json", {"engines": urls, "served_version": served_version})


def save_membership(output_dir: Path, run_id: str, added: dict[str, str | None], removed: list[str]) -> None:
    """The changes this run's pool made so far (added URLs with their API keys, removed URLs): a later
    lifetime of the same run (an orchestrator restart) makes them again at its start."""
    data = {"run_id": run_id, "added": added, "removed": removed}
    write_json(engines_dir(output_dir) / "membership.json", data)


def load_membership(output_dir: Path, run_id: str | None) -> tuple[dict[str, str | None], list[str]]:
    """(added, removed) saved by an earlier lifetime of run `run_id`; nothing for another run's file."""
    path = engines_dir(output_dir) / "membership.json"
    if run_id is None or not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    if data.get("run_id") != run_id:
        return {}, []
    return dict(data.get("added") or {}), list(data.get("removed") or [])


def clear_live(output_dir: Path) -> None:
    """The orchestrator stopped: no engines serve for it any more."""
    (engines_dir(output_dir) / "live.json").unlink(missing_ok=True)


def read_live(output_dir: Path) -> dict[str, Any] | None:
    path = engines_dir(output_dir) / "live.json"
    return json.loads(path.read_text()) if path.exists() else None
