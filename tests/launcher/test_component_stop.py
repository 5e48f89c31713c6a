"""`Component.stop` ends everything its command started, also after the command's own process was
killed: torchrun's agent killed by SIGKILL leaves its worker ranks alive, re-parented out of its tree but
still in its process group (seen in the feature matrix: the orphaned ranks kept training beside the
restarted trainer and the run never ended)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from prime_async.launcher.process import Component
from prime_async.utils.process_tree import alive, descendants


def test_stop_after_the_leader_was_killed_ends_its_group(tmp_path: Path) -> None:
    component = Component(
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
