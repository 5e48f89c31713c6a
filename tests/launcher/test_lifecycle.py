"""Process lifecycle of `rl`: no process of a run survives it, whatever way the run ends.

Each test starts a real `rl` run (tiny model, real trainer and orchestrator) whose inference backend is
"sglang" served by a stand-in `sglang.launch_server` (`standin_sglang/`): real generation from the
embedded engine, plus helper processes shaped like SGLang's (children of a server that runs in a session
of its own, one of them ignoring SIGTERM). Every process of the run inherits a unique marker in its
environment, so survivors are found by scanning /proc, whoever their parent is now.

Exit paths: normal end, SIGTERM and SIGINT to `rl`, a component dying (trainer SIGKILLed, no restarts),
the inference launcher SIGKILLed (its SGLang server is orphaned), and an exception inside `rl` (inference
not healthy within `launch.startup_timeout_s`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import zygote
from prime_async.utils.process_tree import alive
from proc_helpers import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin_sglang"
MARK = "PRIME_ASYNC_LIFECYCLE_MARK"


def _marked_processes(mark: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose environment carries `mark`."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # tolerated: gone while we looked
            continue
        if needle in environ.split(b"\0") and alive(int(entry.name)):
            found.append((int(entry.name), cmd[:160]))
    return found


def _start_rl(out: Path, model_dir: Path, mark: str, *extra: str, steps: int = 2) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir), "--max-steps", str(steps),
        "--inference.backend", "sglang", "--inference.sglang.python", sys.executable,
        "--inference.server.port", "0", "--transport.port", "0", *extra,
    ]  # fmt: skip
    env = {**os.environ, MARK: mark, "PYTHONPATH": f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return zygote.popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _pid_of(mark: str, needle: str) -> int | None:
    return next((pid for pid, cmd in _marked_processes(mark) if needle in cmd), None)


def _assert_nothing_survives(proc: subprocess.Popen, mark: str, expect_status: int | None) -> str:
    output, _ = proc.communicate(timeout=480)  # a loaded 2-core machine needs minutes
    if expect_status is not None:
        assert proc.returncode == expect_status, output[-4000:]
    survivors = _marked_processes(mark)
    for pid, _ in survivors:  # clean up before failing, so one failure does not leak into other tests
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes of the run outlived it: {survivors}\n{output[-3000:]}"
    return output


@pytest.fixture
def mark() -> str:
    return uuid.uuid4().hex


def test_normal_end_leaves_no_process(tiny_model_dir: Path, tmp_path: Path, mark: str) -> None:
    proc = _start_rl(tmp_path / "run", tiny_model_dir, mark)
    output = _assert_nothing_survives(proc, mark, expect_status=0)
    assert "run finished" in output
    assert "stand-in sglang server pid" in (tmp_path / "run" / "logs" / "inference.log").read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_rl_ends_every_process(tiny_model_dir: Path, tmp_path: Path, mark: str, signum) -> None:
    proc = _start_rl(tmp_path / "run", tiny_model_dir, mark, steps=50)
    # rl starts the orchestrator with the engines: wait until the SGLang server is up too
    started = _wait_for(
        lambda: None not in (_pid_of(mark, "orchestrator @"), _pid_of(mark, "sglang.launch_server")), 120
    )
    if not started:
        proc.kill()
    assert started, "orchestrator or SGLang server never started"
    proc.send_signal(signum)
    _assert_nothing_survives(proc, mark, expect_status=128 + signum)


@pytest.mark.parametrize("victim", ["trainer @", "inference @"])
def test_component_killed_ends_every_process(tiny_model_dir: Path, tmp_path: Path, mark: str, victim) -> None:
    """A component SIGKILLed without a restart budget fails the run; the inference launcher's death
    orphans its SGLang server (own session), which must still be ended."""
    proc = _start_rl(tmp_path / "run", tiny_model_dir, mark, steps=50)
    assert _wait_for(lambda: _pid_of(mark, "orchestrator @") is not None, 120), "orchestrator never started"
    pid = _pid_of(mark, victim)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    output = _assert_nothing_survives(proc, mark, expect_status=1)
    assert f"{victim.split()[0]} exited with status -9" in output


def test_exception_in_rl_ends_every_process(tiny_model_dir: Path, tmp_path: Path, mark: str) -> None:
    proc = _start_rl(tmp_path / "run", tiny_model_dir, mark, "--launch.startup-timeout-s", "1")
    output = _assert_nothing_survives(proc, mark, expect_status=None)
    assert proc.returncode != 0 and "not healthy" in output


def _start_embedded_rl(out: Path, model_dir: Path, mark: str, *extra: str, steps: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir), "--max-steps", str(steps), *extra,
    ]  # fmt: skip
    env = {**os.environ, MARK: mark}
    return zygote.popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_second_run_on_default_ports_is_refused(tiny_model_dir: Path, tmp_path: Path, mark: str) -> None:
    """Run A holds the default ports; run B is refused at once, naming the port and run A's engine."""
    # far more steps than it can train before the SIGTERM below (50 took 14.7 s on a quiet machine)
    first = _start_embedded_rl(tmp_path / "a", tiny_model_dir, mark, steps=100_000)
    # rl starts the orchestrator with the engines: run A holds the default ports once its engine answers
    try:
        wait_healthy("http://127.0.0.1:30000", first, timeout_s=240)  # rl checks every env first
    except BaseException:
        first.kill()
        raise
    second = zygote.run(
        [sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
         "--output-dir", str(tmp_path / "b"), "--model.path", str(tiny_model_dir)],
        cwd=ROOT, timeout=120,
    )  # fmt: skip
    first.send_signal(signal.SIGTERM)
    _assert_nothing_survives(first, mark, expect_status=143)
    run_a = next(line for line in (tmp_path / "a" / "configs" / "inference.toml").read_text().splitlines()
                 if line.startswith("run_id"))  # fmt: skip
    assert second.returncode == 2, second.stderr[-2000:]
    refusal = [line for line in second.stderr.splitlines() if "error:" in line]
    assert len(refusal) == 1 and "inference.server.port = 30000 is in use" in refusal[0], second.stderr
    assert f"for run {run_a.split('=')[1].strip().strip(chr(34))}" in refusal[0]
    assert not (tmp_path / "b" / "logs").exists(), "the refused run started something"


def test_two_runs_with_port_zero_both_complete(tiny_model_dir: Path, tmp_path: Path) -> None:
    free = ("--inference.server.port", "0", "--transport.port", "0")
    marks = [uuid.uuid4().hex, uuid.uuid4().hex]
    runs = [
        _start_embedded_rl(tmp_path / name, tiny_model_dir, m, *free, steps=3)
        for name, m in zip("ab", marks, strict=True)
    ]
    outputs = [_assert_nothing_survives(run, m, expect_status=0) for run, m in zip(runs, marks, strict=True)]
    ports = [line.split("inference on ")[1].split(",")[0] for out in outputs for line in out.splitlines()
             if "inference on http" in line]  # fmt: skip
    assert len(set(ports)) == 2, ports
    for name in "ab":
        trainer = (tmp_path / name / "metrics" / "trainer.jsonl").read_text().splitlines()
        assert len(trainer) == 3
