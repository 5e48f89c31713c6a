"""`rl-engines`: add an engine to a running run, remove one, list them, or start one (`docs/elastic.md`).

    add --url URL      an engine already serving (external, or started by hand): the orchestrator checks it
                       is this run's, loads the served version into it, then routes to it
    start [--port P]   starts one engine with the run's own inference config (`configs/inference.toml`,
                       on a free port), then adds it; its pid is recorded in `engines/started/`
    remove --url URL   the orchestrator drains the run, then drops the engine; an engine `start` started
                       is then stopped (SIGTERM to that pid only)
    list               the engines serving now (`engines/live.json`)

The command talks to the orchestrator through files in `output_dir/engines/`
(`orchestrator/engine_requests.py`) and waits for its answer with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from prime_async.orchestrator import engine_requests as requests
from prime_async.orchestrator.engine_requests import EngineRequest, EngineResult

ANSWER_MARGIN_S = 30.0  # the orchestrator polls its requests every second; its own work has `timeout_s`


def change(run_dir: Path, request: EngineRequest) -> EngineResult:
    """Ask the run's orchestrator for `request` and wait for the answer (refused after the deadline)."""
    _require_live(run_dir)
    rid = requests.submit(run_dir, request)
    result = requests.wait_result(run_dir, rid, request.timeout_s + ANSWER_MARGIN_S)
    if result is None:
        with contextlib.suppress(OSError):
            (requests.engines_dir(run_dir) / "requests" / f"{rid}.json").unlink()
        waited = request.timeout_s + ANSWER_MARGIN_S
        return EngineResult(False, f"no orchestrator answered within {waited:.0f} s (is the run live?)")
    if result.ok and request.op == "remove":
        stop_started(run_dir, request.url)
    return result


def start(run_dir: Path, port: int | None, timeout_s: float) -> EngineResult:
    """Start one engine with the run's inference config on `port` (free when None), then add it; an engine
    that could not join is stopped again."""
    _require_live(run_dir)  # before an engine is started that nobody would add
    config = run_dir / "configs" / "inference.toml"
    if not config.exists():
        raise ValueError(f"--run {run_dir}: no configs/inference.toml (the run's engines are not rl's)")
    port = port or _free_port()
    log = run_dir / "logs" / f"inference-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    entry = [sys.executable, "-m", "prime_async.entrypoints.inference"]
    cmd = [*entry, "@", str(config), "--server.port", str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    requests.write_json(_started(run_dir, url), {"pid": proc.pid, "url": url, "log": str(log)})
    result = change(run_dir, EngineRequest("add", url, timeout_s=timeout_s))
    if not result.ok:
        stop_started(run_dir, url)
    return EngineResult(result.ok, f"{result.message} (pid {proc.pid}, log {log})", result.engines)


def stop_started(run_dir: Path, url: str) -> None:
    """SIGTERM the engine `start` started at `url` (nothing when `start` did not start it)."""
    record = _started(run_dir, url)
    if not record.exists():
        return
    pid = int(json.loads(record.read_text())["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    record.unlink(missing_ok=True)


def live(run_dir: Path) -> str:
    """The engines serving now, one line."""
    data = requests.read_live(run_dir)
    if data is None:
        return f"no engines/live.json in {run_dir}: no orchestrator is running there"
    return f"{len(data['engines'])} engine(s) at weight version {data['served_version']}: " + ", ".join(
        data["engines"]
    )


def _require_live(run_dir: Path) -> None:
    """ValueError (one line) unless an orchestrator runs there: its pool writes `live.json` at its start
    and removes it when it stops."""
    if requests.read_live(run_dir) is None:
        raise ValueError(f"--run {run_dir}: no orchestrator is running there (no engines/live.json)")


def _started(run_dir: Path, url: str) -> Path:
    return requests.engines_dir(run_dir) / "started" / f"{url.rsplit(':', 1)[-1]}.json"


def _free_port() -> int:
    from prime_async.launcher.identity import free_ports

    return free_ports("127.0.0.1", 1)  # picked as `rl` picks its engines' ports
