"""No silent hang: a component stopped (SIGSTOP) for longer than `log.stall_after_s` is reported by the
one waiting on it, within that deadline, as one ERROR line plus output_dir/stall.json saying who waits on
whom; after SIGCONT the run completes (restarts on, nothing left running).

One `rl` run on the tiny config stops inference, then the trainer, then the orchestrator, each once a few
steps were logged and only after the previous stall was over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability_soak import ROOT, _component_pid

from proc_helpers import free_port, read_jsonl

DEADLINE_S = 3.0
STOPPED_S = DEADLINE_S + 3.0


@dataclass
class Stop:
    component: str  # the process stopped
    reporter: str  # the component that waits on it
    peer_words: str  # in the report's `waits_on`
    time: float = 0.0  # time.time() of the SIGSTOP


STOPS = [
    Stop("inference", "orchestrator", "inference engines"),
    Stop("trainer", "orchestrator", "trainer"),
    Stop("orchestrator", "trainer", "orchestrator"),
]
STEPS = 30  # a tiny step takes ~0.07 s: room for the three stops, each one step after the last resume


def _stopper(out: Path, stop_flag: threading.Event) -> None:
    metrics = out / "metrics" / "orchestrator.jsonl"
    rows = 2  # the first stop once two steps are logged; each next one step after the previous resume
    for stop in STOPS:
        while not stop_flag.is_set():
            pid = _component_pid(out, stop.component)
            if len(read_jsonl(metrics)) >= rows and pid is not None:
                stop.time = time.time()
                os.kill(pid, signal.SIGSTOP)
                stop_flag.wait(STOPPED_S)
                os.kill(pid, signal.SIGCONT)
                rows = len(read_jsonl(metrics)) + 1
                break
            stop_flag.wait(0.02)


@pytest.mark.timeout(600)
def test_each_stopped_component_is_reported_within_the_deadline(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(tiny_model_dir), "--max-steps", str(STEPS),
        "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--log.stall-after-s", str(DEADLINE_S), "--restart.max-restarts", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
    flag = threading.Event()
    stopper = threading.Thread(target=_stopper, args=(out, flag), daemon=True)
    stopper.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    finally:
        flag.set()
        stopper.join(10)
    logs = {p.stem: p.read_text() for p in (out / "logs").glob("*.log")}
    tails = "\n".join(f"--- {n}\n{t[-2000:]}" for n, t in logs.items())
    assert proc.returncode == 0, f"rl exited {proc.returncode}:\n{proc.stderr[-3000:]}\n{tails}"
    assert sorted({m["step"] for m in read_jsonl(out / "metrics" / "orchestrator.jsonl")}) == list(
        range(STEPS)
    )
    reports = read_jsonl(out / "stalls.jsonl")
    lines = []
    for stop in STOPS:
        assert stop.time, f"{stop.component} was never stopped"
        found = [r for r in reports if r["component"] == stop.reporter and stop.peer_words in r["waits_on"]
                 and r["resolved_after_s"] is None and r["since"] + r["waited_s"] >= stop.time]  # fmt: skip
        near = [r for r in reports if r["since"] + r["waited_s"] >= stop.time - 1]
        assert found, f"no stall report of {stop.reporter} on {stop.component}: {json.dumps(near)[:3000]}"
        reported_at = found[0]["since"] + found[0]["waited_s"]
        lines.append(f"{stop.component} stopped: {stop.reporter} reported after "
                     f"{reported_at - stop.time:.2f} s: waits on {found[0]['waits_on']}")  # fmt: skip
        # reported as the wait passed its deadline, while the component was still stopped (the waiter may
        # keep working for a while, e.g. generating ahead within K, before it has to wait)
        assert DEADLINE_S <= found[0]["waited_s"] <= DEADLINE_S + 0.5, found[0]
        assert reported_at - stop.time <= STOPPED_S, lines[-1]
        assert "stall: " in logs[stop.reporter] and "ERROR" in logs[stop.reporter]
    assert any(r["resolved_after_s"] is not None for r in reports), "no stall was reported over"
    print("\n".join(lines))
