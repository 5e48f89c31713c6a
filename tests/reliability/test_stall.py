"""No silent hang: a component stopped (SIGSTOP) for longer than `log.stall_after_s` is reported by the
one waiting on it, within that deadline, as one ERROR line plus output_dir/stall.json saying who waits on
whom; after SIGCONT the run completes (restarts on, nothing left running).

One `rl` run on the tiny config stops inference, then the trainer, then the orchestrator, each once a few
steps were logged and only after the previous stall was over. The unit tests below drive a real
`StallWatch` (its thread, its files): a resolution keeps the wait as it was reported and appends how it
ended, even when the peer's name changed meanwhile or the wait ended while its report was being written."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability_soak import ROOT, _component_pid

import zygote
from prime_async.utils import stall
from prime_async.utils.stall import StallWatch
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
        proc = zygote.run(cmd, cwd=ROOT, env=env, timeout=540)
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


def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture
def fast_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stall, "CHECK_INTERVAL_S", 0.02)


def test_resolution_keeps_the_reported_wait(
    tmp_path: Path, fast_watch: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The SIGSTOPped-trainer case: reported as waiting on the trainer; by its end the peer callable
    names the engines (the new version is loading). The record and the "stall over" line keep the
    trainer; the resolution says what ended it and whom it waited on by then."""
    peer = ["the trainer: batch 10 needs weights v9 or newer, the engines serve v8"]
    steps = iter(range(100))
    watch = StallWatch("orchestrator", tmp_path, 0.1, describe=lambda: {"call": next(steps)}).start()
    # for the whole test: the watchdog thread may resolve (and log) the wait after the block ends
    caplog.set_level("INFO", logger="prime_async.utils.stall")
    try:
        with watch.waiting("the groups of batch 10", peer=lambda: peer[0]):
            _until(lambda: (tmp_path / "stall.json").exists())
            peer[0] = "the inference engines: weights v9 are published, the engines still serve v8"
    finally:
        watch.stop()
    record = json.loads((tmp_path / "stall.json").read_text())
    assert record["waits_on"].startswith("the trainer: batch 10") and record["state"] == {"call": 0}
    # both rounded to the millisecond: the wait may end within a millisecond of its report
    assert record["waited_s"] <= record["resolved_after_s"] == record["resolution"]["after_s"]
    assert record["resolution"]["ended_by"] == "the wait returned"
    assert record["resolution"]["waits_on_at_end"].startswith("the inference engines")
    assert record["resolution"]["state_at_end"] == {"call": 1}
    assert json.loads((tmp_path / "stall-orchestrator.json").read_text()) == record
    reported, resolved = read_jsonl(tmp_path / "stalls.jsonl")
    assert reported["resolved_after_s"] is None and {**reported, "resolved_after_s": None} == {
        k: v for k, v in {**resolved, "resolved_after_s": None}.items() if k != "resolution"
    }
    over = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall over")]
    assert len(over) == 1 and "on the trainer: batch 10" in over[0], over
    assert "by then it waited on the inference engines" in over[0]


def test_resolution_of_a_failed_wait_leaves_a_newer_stall_in_place(tmp_path: Path, fast_watch: None) -> None:
    """A wait that ends by an exception says so; `stall.json` meanwhile holds another component's newer
    report, which the resolution leaves in place (it goes to stall-<component>.json and stalls.jsonl)."""
    watch = StallWatch("trainer", tmp_path, 0.1).start()
    other = StallWatch("orchestrator", tmp_path, 0.1).start()
    try:
        with pytest.raises(TimeoutError), watch.waiting("batch 4", peer="the orchestrator"):
            _until(lambda: (tmp_path / "stall-trainer.json").exists())
            with other.waiting("batch 4 to be fetched", peer="the trainer"):
                _until(lambda: (tmp_path / "stall-orchestrator.json").exists())
            raise TimeoutError("no batch 4 in 600 s")
    finally:
        watch.stop()
        other.stop()
    newest = json.loads((tmp_path / "stall.json").read_text())
    assert newest["component"] == "orchestrator"
    mine = json.loads((tmp_path / "stall-trainer.json").read_text())
    assert mine["waits_on"] == "the orchestrator" and mine["for"] == "batch 4"
    assert mine["resolution"]["ended_by"] == "TimeoutError: no batch 4 in 600 s"
    assert "waits_on_at_end" in mine["resolution"]


def test_a_wait_that_ends_while_its_report_is_written_is_resolved_once(
    tmp_path: Path, fast_watch: None
) -> None:
    """The watchdog is still writing the report (a slow `describe`) when the wait ends: the watchdog
    resolves it after writing the report, never before, and only once."""
    calls = []

    def slow_describe() -> dict:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.4)
        return {"call": len(calls)}

    watch = StallWatch("trainer", tmp_path, 0.1, describe=slow_describe).start()
    try:
        with watch.waiting("weights v3 to be written", peer="the weight writer"):
            _until(lambda: calls)
        _until(lambda: len(read_jsonl(tmp_path / "stalls.jsonl")) >= 2)
        time.sleep(0.2)
    finally:
        watch.stop()
    rows = read_jsonl(tmp_path / "stalls.jsonl")
    assert [r["resolved_after_s"] is None for r in rows] == [True, False]
    assert rows[1]["state"] == {"call": 1} and rows[1]["resolution"]["state_at_end"] == {"call": 2}
    assert json.loads((tmp_path / "stall.json").read_text()) == rows[1]
