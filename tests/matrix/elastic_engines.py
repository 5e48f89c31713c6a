"""The engine of an elastic feature-matrix cell (`cells.py`, `elastic = on`; docs/elastic.md): an embedded
engine of the run started and healthy before `rl` starts (the inference config `rl` resolves from the cell's
config, whose `run_id` the cell sets; an engine takes ~20 s to start on 2 busy cores, longer than the tiny
run's steps, so one `rl-engines start` started once 2 steps are logged would join after the run),
`rl-engines add` of it once ELASTIC_ADD_AT orchestrator steps are logged, `rl-engines remove` once
ELASTIC_REMOVE_AT steps and one after its join are (both as the command does them, in this process), then
stopped (`rl` does not supervise it).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zygote

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


@dataclass
class Engine:
    """The elastic cell's engine: its URL and process, or why it did not start (recorded as a change)."""

    url: str = ""
    proc: zygote.Process | None = None
    error: str = ""


def start_engine_before(config: dict[str, Any], work: Path, env: dict[str, str]) -> Engine:
    """An embedded engine of the cell's run, started and healthy before `rl` starts: the inference config
    `rl` resolves from the cell's config (its model and `run_id`, set by the cell), on a port of its own, its
    own output_dir and log. Started first because an engine's start-up (~20 s on a loaded 2-core machine)
    outlasts a tiny run's steps; it carries the run's marker, so one left running is a leftover."""
    import tomli_w

    from prime_async.config.rl import RLConfig
    from prime_async.launcher.rl import ensure_model
    from proc_helpers import free_port, wait_healthy

    cfg = RLConfig.model_validate(config)
    ensure_model(cfg)  # a vlm cell's model may not be built yet (atomic, whoever builds first)
    engine_dir = work / "elastic-engine"
    engine_dir.mkdir(exist_ok=True)
    engine_cfg = cfg.inference.model_dump(mode="json", exclude_none=True)
    port = free_port()
    engine_cfg["output_dir"], engine_cfg["server"]["port"] = str(engine_dir), port
    (engine_dir / "inference.toml").write_text(tomli_w.dumps(engine_cfg))
    with (engine_dir / "engine.log").open("w") as log:
        proc = zygote.popen([sys.executable, "-m", "prime_async.entrypoints.inference", "@",
                             str(engine_dir / "inference.toml")], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    engine = Engine(url=f"http://127.0.0.1:{port}", proc=proc)
    try:
        wait_healthy(engine.url, proc, engine_dir / "engine.log", timeout_s=ENGINES_TIMEOUT_S)
    except AssertionError as e:  # recorded: check_elastic reports it
        engine.error = str(e)[-1500:]
    return engine


def change_engines(out: Path, engine: Engine, stop: threading.Event,
                   changes: list[tuple[str, int, str, int]]) -> None:  # fmt: skip
    """Add the engine once ELASTIC_ADD_AT steps are logged, remove it (module docstring), recording each
    command as (op, exit status, output, steps logged after) in `changes`; the engine is stopped once
    removed, refused, or the run ended."""
    try:
        if engine.error:
            changes.append(("engine start", -1, engine.error, 0))
            return
        if not _wait_for(lambda: _steps_logged(out) >= ELASTIC_ADD_AT, stop):
            return
        code, text = _engines_command(out, "add", engine.url)
        changes.append(("add", code, text, _steps_logged(out)))
        after_join = max(ELASTIC_REMOVE_AT, changes[-1][3] + 1)
        if code != 0 or not _wait_for(lambda: _steps_logged(out) >= after_join, stop):
            return
        code, text = _engines_command(out, "remove", engine.url)
        changes.append(("remove", code, text, _steps_logged(out)))
    finally:
        _stop_engine(engine)


def _stop_engine(engine: Engine) -> None:
    if engine.proc is None:
        return
    engine.proc.terminate()
    try:
        engine.proc.wait(30)
    except subprocess.TimeoutExpired:
        engine.proc.kill()
        engine.proc.wait(10)
