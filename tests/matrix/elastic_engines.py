"""The engine of an elastic feature-matrix cell (`cells.py`, `elastic = on`; docs/elastic.md): an embedded
engine of the run started beside `rl` (the run's `configs/inference.toml`: its model and run id; an engine
takes ~20 s to start on 2 busy cores, longer than the tiny run's steps, so one `rl-engines start` started
once 2 steps are logged would join after the run), `rl-engines add` of it once ELASTIC_ADD_AT orchestrator
steps are logged, `rl-engines remove` once ELASTIC_REMOVE_AT steps and one after its join are (both as the
command does them, in this process), then stopped (`rl` does not supervise it).

Invariants: every wait has a deadline or ends with the run (`stop`); the engine carries the run's marker
in its environment, so one left running is a leftover of the cell; each command's exit status and output
are recorded in `changes` for `cells.check_elastic`.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# ELASTIC_STEPS (an elastic cell's max_steps) leave room for the join's load and the leave's drain
ELASTIC_STEPS, ELASTIC_ADD_AT, ELASTIC_REMOVE_AT = 32, 2, 4
ENGINES_TIMEOUT_S = 150  # each `rl-engines` command's deadline (--timeout-s), and an engine's start


def _engines_command(out: Path, op: str, url: str) -> tuple[int, str]:
    """What `rl-engines OP --url URL --run OUT` does, called in this process (the command's own
    `engines_command.change`: the pool's request files), as (exit status, output): 0 done, 1 refused, 2 no
    orchestrator running. A command's interpreter start-up (seconds on a busy machine) is longer than a
    tiny run's steps, so the subprocess would miss the run; the command itself is tested in
    tests/launcher/test_engines_command.py and tests/orchestrator/test_elastic_rl.py. No orchestrator
    running (a kill's restart between two lifetimes) is tried again for up to ENGINES_TIMEOUT_S."""
    from prime_async.launcher import engines_command
    from prime_async.orchestrator.engine_requests import EngineRequest

    request = EngineRequest.parse({"op": op, "url": url, "api_key": None, "timeout_s": ENGINES_TIMEOUT_S})
    deadline = time.monotonic() + ENGINES_TIMEOUT_S
    while True:
        try:
            result = engines_command.change(out, request)
        except ValueError as e:  # no engines/live.json: no orchestrator runs there now
            if time.monotonic() > deadline:
                return 2, f"rl-engines: {e}"
            time.sleep(0.2)
            continue
        return (0 if result.ok else 1), result.message


def _steps_logged(out: Path) -> int:
    from proc_helpers import read_jsonl

    return len(read_jsonl(out / "metrics" / "orchestrator.jsonl"))


def _wait_for(ready: Callable[[], bool], stop: threading.Event) -> bool:
    """Whether `ready()` held before `stop` (rl exited)."""
    while not ready():
        if stop.wait(0.1):
            return False
    return True


def _start_engine(out: Path, env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    """An embedded engine of the run (`inference` with the run's `configs/inference.toml`: its model and
    run id) on a free port, its own output_dir and log beside the run, healthy; it carries the run's
    marker, so one left running is a leftover."""
    import tomllib

    import tomli_w

    from proc_helpers import free_port, wait_healthy

    work = out.parent / "elastic-engine"
    work.mkdir(exist_ok=True)
    cfg = tomllib.loads((out / "configs" / "inference.toml").read_text())
    port = free_port()
    cfg["output_dir"], cfg["server"]["port"] = str(work), port
    (work / "inference.toml").write_text(tomli_w.dumps(cfg))
    with (work / "engine.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prime_async.entrypoints.inference", "@",
                                 str(work / "inference.toml")], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, work / "engine.log", timeout_s=ENGINES_TIMEOUT_S)
    except BaseException:
        proc.kill()
        raise
    return url, proc


def change_engines(out: Path, model: Path, env: dict[str, str], stop: threading.Event,
                   changes: list[tuple[str, int, str, int]]) -> None:  # fmt: skip
    """Start the engine once the run's model and configs exist, add it, remove it (module docstring),
    recording each command as (op, exit status, output, steps logged after) in `changes`; the engine is
    stopped once removed, refused, or the run ended."""
    # rl writes the configs, then builds a missing model (atomically)
    if not _wait_for(lambda: (model / "config.json").exists(), stop):
        return
    if not _wait_for((out / "configs" / "inference.toml").exists, stop):
        return
    try:
        url, engine = _start_engine(out, env)
    except AssertionError as e:  # recorded: check_elastic reports it
        changes.append(("engine start", -1, str(e)[-1500:], _steps_logged(out)))
        return
    try:
        if not _wait_for(lambda: _steps_logged(out) >= ELASTIC_ADD_AT, stop):
            return
        code, text = _engines_command(out, "add", url)
        changes.append(("add", code, text, _steps_logged(out)))
        after_join = max(ELASTIC_REMOVE_AT, changes[-1][3] + 1)
        if code != 0 or not _wait_for(lambda: _steps_logged(out) >= after_join, stop):
            return
        code, text = _engines_command(out, "remove", url)
        changes.append(("remove", code, text, _steps_logged(out)))
    finally:
        engine.terminate()
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait(10)
