"""Start a component by forking `rl` once it has imported what the components import, instead of a fresh
interpreter: torch, transformers, verifiers and the component modules are imported once per run (in `rl`),
not once per process and per restart (~4-8 s of CPU each on a laptop core).

Used by `launcher/process.py` (`ChildProcess.fork`), decided by `launcher/rl.py` (`fork_plan`).

Invariants:
- `rl` forks only while it is single-threaded (`can_fork`; otherwise the component is exec'd as before),
  only components that run one console script of this package (`FORKABLE`; never torchrun), and only when
  no component is placed on a GPU (`launcher/gpus.py`): CUDA is never initialised in `rl`, and GPU runs keep
  the exec path.
- The child looks to its component like an exec'd child: a session of its own, stdout and stderr appended
  to its log, stdin from /dev/null, exactly its environment (`os.environ` replaced), its argv, the default
  signal dispositions, none of `rl`'s logging handlers or atexit functions, fresh random seeds; `ps` shows
  `<command> @ <config>` (setproctitle, within `rl`'s own argv area, so /proc/<pid>/environ still shows
  the environment `rl` was started with).
- The child never returns into `rl`'s code: it ends in `os._exit` with the command's exit status (a
  signal's death is reported as by `subprocess`, negative).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from importlib.util import find_spec
from pathlib import Path

logger = logging.getLogger(__name__)

# What the forked components import; each is imported by `preload()` in `rl` (a missing optional one is
# skipped: its component imports it itself, or fails there with its own message).
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.modeling_auto",
    "verifiers.v1",
    "prime_async.inference.server",
    "prime_async.trainer.train",
    "prime_async.orchestrator.main",
    "prime_async.rollouts.verifiers_source",
)
FORKABLE = ("inference", "trainer", "orchestrator")  # console scripts `rl` starts as components
_WAIT_POLL_S = 0.02
_preloaded_threads: list[int] = []  # native thread count right after `preload()`


def preload() -> float:
    """Import `PRELOAD` into this process and note its native thread count; returns the seconds it took.

    Only in a process that never ran a torch op (`rl` forks only when it did not build the model): numpy's
    OpenBLAS pool (started by its import) survives a fork, torch's intra-op pool, once used, does not (the
    child hangs in its first parallel op)."""
    started = time.monotonic()
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError as e:  # tolerated: the component imports it itself and reports what is missing
            logger.debug("fork preload: %s not imported: %s", module, e)
    _preloaded_threads[:] = [_native_threads()]
    return time.monotonic() - started


def can_fork() -> bool:
    """True when `preload()` ran and no Python or native thread was started since: only then is a fork safe.
    (A fork may end numpy's OpenBLAS pool in this process, so fewer native threads than then is fine.)"""
    if threading.active_count() != 1 or not _preloaded_threads:
        return False
    return 0 < _native_threads() <= _preloaded_threads[0]


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc (not Linux): a count no check matches
        return -1


def forkable_command(command: list[str]) -> EntryPoint | None:
    """The console-script entry point when `command` is `<script> @ <config> [flags]` of a component
    (`FORKABLE`) whose title fits in this process's argv area (so `ps` shows the whole config path)."""
    name = Path(command[0]).name
    if name not in FORKABLE or len(command) < 3 or command[1] != "@" or not find_spec("setproctitle"):
        return None
    try:
        argv_area = len(Path("/proc/self/cmdline").read_bytes())
    except OSError:  # no /proc (not Linux): never fork
        return None
    scripts = [
        ep for ep in entry_points(group="console_scripts", name=name) if ep.value.startswith("prime_async.")
    ]
    return scripts[0] if scripts and len(title(command)) < argv_area else None


def title(command: list[str]) -> str:
    """What `ps` shows for a forked component: `orchestrator @ <config> [flags]`."""
    return " ".join([Path(command[0]).name, *command[1:]])


@dataclass
class ForkedChild:
    """A forked child of this process, with the part of `subprocess.Popen` the launcher uses."""

    pid: int
    args: list[str]
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_WAIT_POLL_S)
        assert self.returncode is not None
        return self.returncode


def fork_command(script: EntryPoint, command: list[str], env: dict[str, str], log_path: Path) -> ForkedChild:
    """Fork a child that runs the console script `script` as `command` would (see the module invariants)."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing buffered in rl is written twice
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            code = _child_main(script, command, env, log_fd)
        finally:
            os._exit(code)
    os.close(log_fd)
    return ForkedChild(pid=pid, args=command)


def _child_main(script: EntryPoint, command: list[str], env: dict[str, str], log_fd: int) -> int:
    _become_component(command, env, log_fd)
    return run_to_exit(lambda: script.load()())  # what the console script does: sys.exit(main())


def run_to_exit(main: Callable[[], object]) -> int:
    """Run `main` as an interpreter's top level would and return the process's exit status: `main`'s
    return value or its `SystemExit` code, 1 after an uncaught exception (its traceback printed); exit
    functions run and stdout/stderr flushed, so the caller may `os._exit` with it (a forked child)."""
    try:
        code = _exit_code(main())
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # tolerated: reported as an exec'd Python would, then the status is 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):  # tolerated: exit functions must not keep the child alive
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _exit_code(code: object) -> int:
    """The exit status Python gives `SystemExit(code)` (a message goes to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _become_component(command: list[str], env: dict[str, str], log_fd: int) -> None:
    """Turn this fresh fork of `rl` into the component's process (the module invariants)."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    forget_parent_state()
    _set_title(command)  # before the environment changes: setproctitle finds rl's argv area through it
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(command)
    _reseed()


def forget_parent_state() -> None:
    """In a fresh fork: default signal dispositions (SIGINT raising KeyboardInterrupt, as at start-up), and
    none of the parent's exit functions or root logging handlers."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    atexit._clear()
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)


def _reseed() -> None:
    """Fresh seeds, as a new interpreter would have (Python's `random` reseeds itself after a fork)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _set_title(command: list[str]) -> None:
    """`ps` shows `<script name> @ <config> ...` (cut to `rl`'s argv area; environ left as it is)."""
    os.environ["SPT_NOENV"] = "1"
    import setproctitle  # present: `forkable_command` checked

    setproctitle.setproctitle(title(command))
