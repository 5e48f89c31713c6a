"""`ChildProcess.stop` ends everything its command started, also after the command's own process was
killed: torchrun's agent killed by SIGKILL leaves its worker ranks alive, re-parented out of its tree but
still in its process group (seen in the feature matrix: the orphaned ranks kept training beside the
restarted trainer and the run never ended)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from prime_async.launcher.process import ChildProcess
from prime_async.utils.process_tree import alive, descendants


def test_stop_after_the_leader_was_killed_ends_its_group(tmp_path: Path) -> None:
    component = ChildProcess(
        name="trainer", command=["bash", "-c", "sleep 300 & wait"], log_path=tmp_path / "t.log"
    )
    component.start()
    assert component.process is not None
    deadline = time.monotonic() + 10
    while not (workers := descendants(component.process.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers, "the worker never started"
    os.kill(component.process.pid, signal.SIGKILL)  # the agent dies; its worker is re-parented
    component.process.wait(timeout=10)
    assert all(alive(w) for w in workers)
    component.stop(timeout_s=5)
    deadline = time.monotonic() + 5
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), "the killed leader's worker outlived stop()"


SCENARIO = """
import os, signal, sys, time
from pathlib import Path
from prime_async.launcher.process import ChildProcess
from prime_async.launcher.rl import _end_orphans
from prime_async.utils.process_tree import alive, become_subreaper, children, descendants

become_subreaper()  # as `rl` does
component = ChildProcess(name="trainer", command=["bash", "-c", "setsid sleep 300 & wait"],
                      log_path=Path(sys.argv[1]))
component.start()
deadline = time.monotonic() + 10
def in_own_session(pids):
    try:
        return bool(pids) and all(os.getsid(w) == w for w in pids)
    except ProcessLookupError:
        return False
# the worker is found as soon as bash forks it, before `setsid` has moved it out of the group
while not in_own_session(workers := descendants(component.process.pid)) and time.monotonic() < deadline:
    time.sleep(0.05)
assert in_own_session(workers), "the worker never reached a session of its own"
os.kill(component.process.pid, signal.SIGKILL)  # torchrun's agent dies; its worker has its own session
component.process.wait(timeout=10)  # SIGKILL lands asynchronously: until then the worker is still its child
component.stop(timeout_s=2)
assert all(alive(w) for w in workers), "stop() alone cannot reach a worker of another session"
assert set(workers) <= set(children(os.getpid())), "the orphan is re-parented to the subreaper"
_end_orphans({"trainer": component})
time.sleep(0.2)
print("left:", [w for w in workers if alive(w)])
"""


def test_a_dead_components_worker_in_its_own_session_is_ended_before_a_restart(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own: when the agent is SIGKILLed, the ranks are in
    neither its tree nor its group. `rl` (a subreaper) inherits them and ends them before the restart."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path / "t.log")], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left: []" in proc.stdout, proc.stdout
