"""One supervised child process of the `rl` launcher: start, health-wait, stop, exit status, log file.

Invariant: `stop()` never leaves the child or any of its descendants running (torchrun workers, SGLang's
server, scheduler and detokenizer, even those in a session of their own): SIGTERM to the group and to every
descendant found by `process_tree`, then SIGKILL after the timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from prime_async.launcher.forking import ForkedChild, can_fork, fork_command, forkable_command
from prime_async.utils.process_tree import descendants, group_members, kill_tree

logger = logging.getLogger(__name__)


def tail_lines(path: Path, num_lines: int) -> list[str]:
    """Last `num_lines` lines of a text file ([] when it does not exist)."""
    if not path.exists():
        return []
    with path.open(errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=num_lines)]


@dataclass
class ChildProcess:
    """A child process whose stdout+stderr go to `log_path`."""

    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    fork: bool = False  # fork `rl` rather than exec the command, where `launcher/forking.py` allows it
    process: subprocess.Popen | ForkedChild | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        logger.info("starting %s: %s (log: %s)", self.name, " ".join(self.command), self.log_path)
        script = forkable_command(self.command) if self.fork else None
        if script is not None and can_fork():
            log.close()
            self.process = fork_command(script, self.command, self.env or dict(os.environ), self.log_path)
            return
        # A new session makes the child a process-group leader so that stop() reaches its children.
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env or None, start_new_session=True
        )
        log.close()

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def exited_ok(self) -> bool:
        return self.returncode() == 0

    def wait_healthy(self, *, timeout_s: float, stop_flag: list[int]) -> None:
        """Poll `health_url` until it answers 200; fail early if the process exits."""
        assert self.health_url is not None, f"{self.name} has no health url"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop_flag:
            if self.returncode() is not None:
                code = self.returncode()
                raise RuntimeError(f"{self.name} exited with status {code} before it was healthy")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as response:
                    if response.status == 200:
                        logger.info("%s is healthy at %s", self.name, self.health_url)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # tolerated: the server is still starting
            time.sleep(0.5)
        if not stop_flag:
            raise RuntimeError(f"{self.name} not healthy at {self.health_url} after {timeout_s:.0f} s")

    def stop(self, *, timeout_s: float) -> None:
        if self.process is None:
            return
        # Snapshot first: once the child exits, its children are re-parented and no longer under it; they
        # stay in its process group though, also when the leader was killed before we got here.
        tree = (*descendants(self.process.pid), *group_members(self.process.pid))
        self._signal_group(signal.SIGTERM)  # the leader may be dead and its group alive
        # Descendants outside the group (new sessions, e.g. SGLang's) are ended too.
        kill_tree(self.process.pid, timeout_s=timeout_s, also=tree)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s: killing it", self.name, timeout_s)
            self._signal_group(signal.SIGKILL)
            self.process.wait(timeout=5)

    def _signal_group(self, signum: int) -> None:
        assert self.process is not None
        # Tolerated: the child may exit between poll() and the signal.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)
