"""Helpers of the fault/soak tests: run `rl` as a real process, kill its components at given steps, and
check the run afterwards from what the processes wrote (metrics JSONL, logs, checkpoints).

Used by `test_faults.py` (CI, shortened) and `scripts/soak.sh` (full: SOAK_STEPS=50+).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zygote
from proc_helpers import free_port, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = ("inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled")


@dataclass
class Kill:
    component: str  # inference | trainer | orchestrator | teacher_inference
    at_step: int  # after this many orchestrator metric rows exist
    after: str | None = None  # ... and once this path (relative to the run's output dir) exists
    pid: int = 0
    time: float = 0.0  # time.time() of the signal
    signum: int = signal.SIGKILL  # SIGTERM: a planned stop
    again_after_log: str | None = None  # send the signal again once the component logged this line
    repeated: bool = False  # ... and it was still running then


@dataclass
class SoakRun:
    out: Path
    steps: int
    k: int
    pause_mode: str
    max_buffered_groups: int
    kills: list[Kill] = field(default_factory=list)
    returncode: int | None = None
    stderr: str = ""


def _component_pid(out: Path, component: str) -> int | None:
    """PID of the running `<component> @ out/configs/<component>*.toml` process."""
    needle = str(out / "configs" / component)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:  # tolerated: the process exited while we looked
            continue
        if f"@ {needle}" in " ".join(cmd):  # exec'd `.../orchestrator @ <config>`, or a fork's title
            return int(entry.name)
    return None


# the orchestrator's (or trainer's) log line that says a killed component is back in the run
RECOVERED = {
    "inference": ("orchestrator", "engines healthy again"),
    "trainer": ("trainer", "resumed from"),
    "orchestrator": ("orchestrator", "resumed from orchestrator checkpoint"),
    "teacher_inference": ("orchestrator", "teacher answers again"),
}


def _killer(run: SoakRun, stop: threading.Event) -> None:
    """SIGKILL each component in turn once `at_step` orchestrator rows exist, and only after the previous
    one is back in the run (its recovery line is logged; at most 60 s): a fast run would otherwise
    reach the next kill while the previous outage is still being handled."""
    metrics = run.out / "metrics" / "orchestrator.jsonl"
    for kill in run.kills:
        while not stop.is_set():
            rows = len(read_jsonl(metrics))
            pid = _component_pid(run.out, kill.component)
            ready = kill.after is None or (run.out / kill.after).exists()
            if rows >= kill.at_step and ready and pid is not None:
                kill.pid, kill.time = pid, time.time()
                logs = {name: _log_size(run.out, name) for name in ("orchestrator", "trainer")}
                os.kill(pid, kill.signum)
                break
            stop.wait(0.05)
        else:
            return
        if kill.again_after_log is not None:
            _signal_again(run, kill, logs, stop)
        deadline = time.monotonic() + 60.0
        while not stop.is_set() and time.monotonic() < deadline and not _back(run.out, kill, logs):
            stop.wait(0.05)
        # no settle time: a tiny-config step takes ~0.1 s, so a pause here let the run end before the
        # last kill (its component then was never killed)


def _signal_again(run: SoakRun, kill: Kill, sizes: dict[str, int], stop: threading.Event) -> None:
    """Send `kill.signum` to the killed process again once its log has `kill.again_after_log` past the
    log's size at the kill (at most 60 s); `kill.repeated` says whether it was still there to get it."""
    path = run.out / "logs" / f"{kill.component}.log"
    deadline = time.monotonic() + 60.0
    while not stop.is_set() and time.monotonic() < deadline:
        if path.exists():
            with path.open("rb") as f:
                f.seek(sizes.get(kill.component, 0))
                if kill.again_after_log.encode() in f.read():
                    try:
                        os.kill(kill.pid, kill.signum)
                        kill.repeated = True
                    except ProcessLookupError:  # tolerated: it exited first; the caller sees repeated
                        pass
                    return
        stop.wait(0.005)


def _log_size(out: Path, name: str) -> int:
    path = out / "logs" / f"{name}.log"
    return path.stat().st_size if path.exists() else 0


def _back(out: Path, kill: Kill, sizes: dict[str, int]) -> bool:
    """Whether the recovery line of `kill` was logged after the kill (past the log's size at the kill)."""
    log, needle = RECOVERED[kill.component]
    path = out / "logs" / f"{log}.log"
    if not path.exists():
        return False
    with path.open("rb") as f:
        f.seek(sizes[log])
        return needle.encode() in f.read()


def run_rl(
    run: SoakRun,
    *,
    model_dir: Path,
    timeout_s: float,
    extra: list[str] = (),
    trainer_ckpt_interval: int = 2,
    orchestrator_ckpt_interval: int | None = 1,
    config: Path = ROOT / "configs/tiny/rl.toml",
) -> SoakRun:
    """Run `rl` on `config` (the tiny one) with restarts enabled and `run.kills` applied; fills
    returncode/stderr."""
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(config),
        "--output-dir", str(run.out), "--model.path", str(model_dir),
        "--max-steps", str(run.steps), "--inference.server.port", str(free_port()),
        "--transport.port", str(free_port()), "--weights.pause-mode", run.pause_mode,
        "--orchestrator.max-off-policy-steps", str(run.k),
        "--orchestrator.admission.max-buffered-groups", str(run.max_buffered_groups),
        "--restart.max-restarts", "1", "--restart.backoff-s", "0.5",
        "--orchestrator.admission.unused-handler", "retry",
        "--trainer.ckpt.interval", str(trainer_ckpt_interval), *extra,
    ]  # fmt: skip
    if orchestrator_ckpt_interval is not None:
        cmd += ["--orchestrator.data.ckpt.interval", str(orchestrator_ckpt_interval)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    stop = threading.Event()
    killer = threading.Thread(target=_killer, args=(run, stop), daemon=True)
    killer.start()
    try:
        proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=timeout_s)
    finally:
        stop.set()
        killer.join(10)
    run.returncode, run.stderr = proc.returncode, proc.stderr
    return run


def assert_engines_serve_the_resume_step(rl_stderr: str, orchestrator_log: str) -> str:
    """After every rollback, the engines serve the version the trainer resumes from, and the restarted
    orchestrator found exactly that version and starts its first batch there (staleness never < 0)."""
    rollbacks = [int(s) for s in re.findall(r"rolls back to its checkpoint of step (\d+)", rl_stderr)]
    starts = re.findall(r"engines serve weight version (\d+); first batch is step (\d+)", orchestrator_log)
    assert rollbacks, rl_stderr[-3000:]
    assert len(starts) == len(rollbacks) + 1, starts  # the first lifetime, then one per rollback
    for step, (served, first) in zip(rollbacks, starts[1:], strict=True):
        assert int(served) == step == int(first), (rollbacks, starts)
    return f"rollbacks to steps {rollbacks}: engines served exactly those versions after each"


def lifetimes(rows: list[dict]) -> list[list[dict]]:
    """Orchestrator metric rows split per process lifetime (the ledger restarts with the process)."""
    out: list[list[dict]] = []
    for row in rows:
        if not out or row["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(row)
    return out


def trained_prompts(out: Path, step: int) -> set[tuple[int, int]]:
    """(example, epoch) trained through `step`, from the orchestrator checkpoint of that step: every prompt
    issued by the seeded order up to `position`, minus those saved as issued-but-untrained (retry)."""
    from prime_async.orchestrator.data_source import DataSource

    saved = json.loads((out / "checkpoints" / "orchestrator" / f"step_{step}.json").read_text())
    (state,) = saved["envs"].values()  # the soak trains one environment
    issued: set[tuple[int, int]] = set()
    if state["num_examples"] is None:  # a streamed taskset: ids 0, 1, 2, ... in draw order, epoch 0
        issued = {(e, 0) for e in range(state["position"])}
    for epoch in range(state["epoch"] + 1 if state["num_examples"] is not None else 0):
        data = DataSource(num_examples=state["num_examples"], seed=state["seed"], shuffle=state["shuffle"])
        order = data._make_order(epoch)
        upto = state["position"] if epoch == state["epoch"] else len(order)
        issued |= {(int(e), epoch) for e in order[:upto]}
    return issued - {(int(e), int(ep)) for e, ep in state["retry"]}
