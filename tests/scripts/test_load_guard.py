"""The benchmarks' load guard (scripts/machine_load.py, `bench_agentic.py --guard-only`): the decision on
synthetic samples (the quiet case cannot be run for real where other pytest workers share the cores), the
per-process accounting of /proc snapshots, and for real, next to a CPU-burning process: the refusal (exit
3, one line on stderr naming it) and, with `--allow-loaded`, that the sampler during the stand-in counts it
and not the benchmark's own burning grandchild."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
# a child of this test, not of the benchmark: foreign to it; bounded in time, renamed to be found by name
BURNER = (
    "import ctypes, time\nctypes.CDLL(None).prctl(15, b'busy_burner', 0, 0, 0)\n"
    "end = time.monotonic() + 30\nwhile time.monotonic() < end:\n    pass"
)


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("machine_load", REPO / "scripts" / "machine_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["machine_load"] = module
    spec.loader.exec_module(module)
    return module


ml = _load_module()


def _samples(cores: list[float], seconds: float = 1.0) -> list:
    return [ml.Sample(seconds=seconds, others={"99 busy": c * seconds}, machine=c * seconds) for c in cores]


def test_judge_quiet_mean_and_sustained_peak() -> None:
    quiet = ml.judge(_samples([0.02] * 50 + [0.6, 0.6]))  # an idle machine and a short blip
    assert not quiet.loaded and quiet.reason == "" and quiet.other_cores < 0.05
    mean = ml.judge(_samples([0.3] * 10))
    assert mean.loaded and "0.30 cores on average" in mean.reason
    assert mean.others_top == [(99, "busy", pytest.approx(3.0))]
    assert "pid 99 (busy) 3.0 core-s" in mean.culprits()
    burst = ml.judge(_samples([0.0] * 100 + [0.9] * 6 + [0.0] * 100))  # mean 0.03, but 6 s of 0.9 core
    assert burst.loaded and burst.peak_seconds == 6.0 and "for 6 s in a row" in burst.reason
    short = ml.judge(_samples([0.0] * 100 + [0.9] * 3 + [0.0] * 100, seconds=1.5))  # 4.5 s < 5 s
    assert not short.loaded and short.peak_seconds == 4.5
    restored = ml.LoadReport.from_dict(json.loads(json.dumps(mean.to_dict())))
    assert restored == mean


def test_hidden_machine_time_counts_as_the_others() -> None:
    sample = ml.Sample(seconds=2.0, others={}, own={"1 rl": 2.0}, machine=3.0)
    report = ml.judge([sample])
    assert report.other_cores == pytest.approx(0.5) and report.loaded
    assert "no process shown (interrupts, steal, hidden) 1.0 core-s" in report.culprits()


def test_parse_stat_with_an_odd_command_name() -> None:
    fields = ["S", "7", *["0"] * 9, "30", "20", "5", "5", *["0"] * 4, "12345", "0"]
    key, proc = ml.parse_stat(f"4321 (a (b) c) {' '.join(fields)}")
    assert key == (4321, 12345) and proc == ml.Proc(4321, 7, "a (b) c", 50, 10)


def test_deltas_count_vanished_descendants_once() -> None:
    tick = int(ml.TICK)
    parent, child, grandchild = (1, 0), (2, 0), (3, 0)
    prev = {parent: ml.Proc(1, 0, "bench", 0, 0), child: ml.Proc(2, 1, "sh", tick, 0),
            grandchild: ml.Proc(3, 2, "burn", 4 * tick, 0)}  # fmt: skip
    # both ended; the parent reaped the child, which had reaped the grandchild: 1 + 6 s in cutime
    cur = {parent: ml.Proc(1, 0, "bench", 0, 7 * tick), (2, 9): ml.Proc(2, 1, "new", tick, 0)}
    deltas = ml.interval_deltas(prev, cur)
    assert deltas[parent] == pytest.approx(2.0)  # the 2 s the grandchild burnt after the last sample
    assert deltas[(2, 9)] == pytest.approx(1.0)  # a reused pid is a new process


@pytest.fixture
def burner() -> Iterator[subprocess.Popen[bytes]]:
    """A process burning one core for at most 30 s, named `busy_burner`, killed at the end of the test."""
    proc = subprocess.Popen([sys.executable, "-c", BURNER])
    try:
        time.sleep(0.5)  # renamed and burning
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _guard(out_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(REPO / "scripts/bench_agentic.py"), "--guard-only", "2", "--out-dir",
           str(out_dir), *flags]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_refuses_next_to_a_busy_process(tmp_path: Path, burner: subprocess.Popen[bytes]) -> None:
    result = _guard(tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert "machine loaded before the stand-in" in line and f"pid {burner.pid} (busy_burner)" in line
    assert "LOADED MACHINE" not in result.stdout and not (tmp_path / "bench_load.json").exists()


def test_sampler_counts_the_busy_process_not_our_own(tmp_path: Path, burner: subprocess.Popen[bytes]) -> None:
    result = _guard(tmp_path, "--allow-loaded")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("LOADED MACHINE: ratios not trustworthy")
    during = ml.LoadReport.from_dict(json.loads((tmp_path / "bench_load.json").read_text())["during"])
    others = {pid: (comm, used) for pid, comm, used in during.others_top}
    assert during.loaded and others[burner.pid][0] == "busy_burner" and others[burner.pid][1] > 0.3
    # the stand-in's grandchild burnt about one core; it is ours, never the others'
    assert during.own_cores > 0.3 and during.own_top[0][2] > 0.5
    assert not {pid for pid, _, _ in during.own_top} & set(others)
