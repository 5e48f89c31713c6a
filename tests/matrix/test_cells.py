"""The matrix's own machinery, checked without running `rl`: what `leftover_processes` counts as a process
left by a cell's run (real processes: one seen in the run's tree, one that only carries the run's marker
in its environment, as an orphan re-parented away from the tree would), and what it does not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cells import RUN_MARKER, _start_time, leftover_processes


def _sleeper(env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def test_leftovers_are_the_runs_tree_and_its_marked_processes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    marked = _sleeper({**os.environ, RUN_MARKER: str(out)})
    in_tree = _sleeper()
    other_run = _sleeper({**os.environ, RUN_MARKER: str(tmp_path / "other")})
    unrelated = _sleeper()
    procs = [marked, in_tree, other_run, unrelated]
    try:
        deadline = time.monotonic() + 10
        while any(_start_time(p.pid) is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = {in_tree.pid: _start_time(in_tree.pid)}
        found = {int(line.split()[0]) for line in leftover_processes(out, seen)}
        assert found == {marked.pid, in_tree.pid}
        # a pid seen in the tree but reused by a later process (another start time) is not the run's
        found = {int(line.split()[0]) for line in leftover_processes(out, {in_tree.pid: "0"})}
        assert found == {marked.pid}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert leftover_processes(out, seen) == []
