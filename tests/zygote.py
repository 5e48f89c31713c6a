"""A pre-imported interpreter for the tests' commands: a fork server that imports what the project's
commands import once per pytest worker and forks one child per command a test starts.

Why: a tiny `rl` run is mostly interpreter start-up. `rl` imports torch, transformers, verifiers and the
component modules before it forks its components (`launcher/forking.py`), ~8 s of CPU on a quiet 2-core
machine and twice that on a loaded one, paid again by every run; an `inference` engine a test starts pays
~5 s. The suite starts well over a hundred such commands (the matrix alone 44 `rl` runs). Measured: a
3-step tiny `rl` run costs 10.5 s of CPU started plainly, 3.2 s forked from the zygote.

Which commands: `[sys.executable, "-m", "prime_async.entrypoints.<name>", *args]`, exactly what the tests
build; anything else (and everything with `ZYGOTE=0` in the environment) starts as a plain process.

What the child is: the command's process, as `subprocess.Popen` would start it. Invariants (kept by
`_become_command`):
- its own pid, with the given argv (`sys.argv`), environment (exactly: `os.environ` replaced), working
  directory (also `sys.path[0]`, as `-m` sets it), stdin /dev/null, stdout and stderr on the descriptors
  the test gave (sent over the socket, SCM_RIGHTS);
- default signal dispositions, no exit function or logging handler of the zygote, fresh random seeds;
- `ps` shows `<python> -m prime_async.entrypoints.<name> <args>` (the zygote's argv area is padded so that
  `rl`'s own forked components' titles fit too);
- no torch op ever ran in the zygote and it has one thread, so `rl` may fork its components as it does
  when started on its own (`launcher/forking.can_fork`);
- it runs the module's `main()`, as `python -m` does, and exits with the status Python would give.
What differs: its parent is the zygote, not the test, so the test learns its exit status from the zygote
(`ZygoteProcess.poll`/`wait`) and never reaps it itself.

Protocol (a Unix stream socket, one connection per child): the test sends one JSON line
`{"module": ..., "argv": [...], "env": {...}, "cwd": "..."}` with three descriptors; the zygote answers
`{"pid": N}` at once and `{"returncode": R}` when the child has exited, then closes the connection. Only
the tests use it: users start the commands as plain processes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prime_async.launcher.forking import forget_parent_state, run_to_exit

ENTRYPOINTS = "prime_async.entrypoints."
_PRELOADED = ("rl", "inference", "trainer", "orchestrator", "rl_engines")  # entry modules imported at start
_ENV_ROOM = 65536  # spare bytes in the zygote's environment block, for its children's (`_show_environment`)
_ARGV_PAD = 4096  # bytes of the zygote's argv area: room for the titles of rl's forked components
_START_TIMEOUT_S = 300.0
_BASE_PATH: list[str] = []  # the zygote's sys.path without its script directory and PYTHONPATH
_lock = threading.Lock()
_server: tuple[subprocess.Popen, str] | None = None


# ---------------------------------------------------------------- the test's side


class ZygoteProcess:
    """A command's process forked by the zygote, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], pipes: dict[str, _Collector]) -> None:
        self._conn = conn
        self._buffer = b""
        self._pipes = pipes  # "stdout"/"stderr" given as PIPE: read into memory as the child writes
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._read(block=False)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._conn.settimeout(left)
            with contextlib.suppress(TimeoutError):
                self._read(block=True)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """What `Popen.communicate` gives with `text=True` (None for a stream not given as PIPE)."""
        self.wait(timeout)
        texts = {name: collector.text() for name, collector in self._pipes.items()}
        return texts.get("stdout"), texts.get("stderr")

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, *, block: bool) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not block:
            self._conn.setblocking(False)
        try:
            chunk = self._conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return None
        if not chunk:  # the zygote died: the child's status is lost
            self.returncode = -signal.SIGKILL
        self._buffer += chunk
        if b"\n" in self._buffer:
            self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["returncode"])
        if self.returncode is not None:
            self._conn.close()
        return self.returncode


class _Collector:
    """Reads one end of a pipe into memory on a thread until every writer has closed it."""

    def __init__(self, fd: int) -> None:
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as stream:
            while chunk := stream.read1(65536):
                self._chunks.append(chunk)

    def text(self) -> str:
        self._thread.join(30)  # the command exited: only its own children could still hold the pipe
        return b"".join(self._chunks).decode(errors="replace")


Process = ZygoteProcess | subprocess.Popen  # what `popen` returns


def popen(
    cmd: list[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> ZygoteProcess | subprocess.Popen:
    """`subprocess.Popen(cmd, cwd=, env=, stdout=, stderr=, text=True)`, forked from this worker's zygote
    when `cmd` is one of the project's entry modules (see the module docstring). stdout/stderr: None (this
    process's), a descriptor, a file object, `subprocess.DEVNULL`, `subprocess.PIPE` (read back with
    `communicate`), or `subprocess.STDOUT` for stderr. The caller may close its copies once this returns."""
    env = dict(os.environ if env is None else env)
    module = _entry_module(cmd)
    if module is None or os.environ.get("ZYGOTE") == "0" or env.get("ZYGOTE") == "0":
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                text=True)  # fmt: skip
    devnull = os.open(os.devnull, os.O_RDWR)
    pipes: dict[str, _Collector] = {}
    write_ends: list[int] = []  # of the PIPE streams: closed here once the child holds them
    try:
        fds = [devnull]
        for name, target in (("stdout", stdout), ("stderr", stderr)):
            if target == subprocess.PIPE:
                read_end, write_end = os.pipe()
                pipes[name] = _Collector(read_end)
                write_ends.append(write_end)
                fds.append(write_end)
            elif target == subprocess.STDOUT:
                fds.append(fds[1])
            else:
                fds.append(_fd(target, len(fds), devnull))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(_START_TIMEOUT_S)
        conn.connect(_socket_path())
        request = {"module": module, "argv": cmd[3:], "env": env, "cwd": str(cwd or os.getcwd())}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
    finally:
        for fd in (devnull, *write_ends):
            os.close(fd)
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise RuntimeError("the zygote closed the connection before it forked")
        line += chunk
    return ZygoteProcess(conn, int(json.loads(line)["pid"]), list(cmd), pipes)


def run(
    cmd: list[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=, env=, capture_output=True, text=True, timeout=)` through `popen`."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _entry_module(cmd: list[str]) -> str | None:
    """`prime_async.entrypoints.<name>` when `cmd` is `[this python, -m, that module, ...]`."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2].startswith(ENTRYPOINTS):
        return cmd[2]
    return None


def _fd(target: Any, default: int, devnull: int) -> int:
    if target is None:
        return default
    if target == subprocess.DEVNULL:
        return devnull
    if isinstance(target, int) and target >= 0:
        return target
    if hasattr(target, "fileno"):
        return target.fileno()
    raise ValueError(f"zygote.popen: unsupported stdout/stderr {target!r}")


def _socket_path() -> str:
    """The zygote's socket, started on first use (one per test process) and stopped when it exits."""
    global _server
    with _lock:
        if _server is None or _server[0].poll() is not None:
            path = tempfile.mkdtemp(prefix="zygote-") + "/socket"
            with open(path.replace("socket", "zygote.log"), "w") as log:  # its own complaints only
                proc = subprocess.Popen(
                    [sys.executable, __file__, path, "x" * _ARGV_PAD],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    env={**os.environ, "ZYGOTE_ENV_ROOM": "x" * _ENV_ROOM},
                )  # fmt: skip
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not os.path.exists(path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"the zygote did not start (exit {proc.poll()})")
                time.sleep(0.05)
            atexit.register(_stop, proc)
            _server = (proc, path)
        return _server[1]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


# ---------------------------------------------------------------- the zygote's side


def _pythonpath(env: dict[str, str]) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def serve(path: str) -> None:
    """Import what `rl` imports, then fork a child per connection until the parent test process is gone."""
    own = set(_pythonpath(dict(os.environ)))
    _BASE_PATH[:] = [entry for entry in sys.path[1:] if entry not in own]
    from prime_async.launcher.forking import preload

    preload()
    for name in _PRELOADED:
        importlib.import_module(ENTRYPOINTS + name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while os.getppid() == parent:
        if selector.select(timeout=0.05):
            conn, _ = listener.accept()
            pid = _fork_command(conn, [listener, *waiting.values()])
            if pid is not None:
                waiting[pid] = conn
        _reap(waiting)


def _fork_command(conn: socket.socket, others: list[socket.socket]) -> int | None:
    """Fork the requested command's process (`others`: the zygote's sockets, which the child closes)."""
    conn.settimeout(30)
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        request = json.loads(message)
    except (OSError, ValueError) as e:  # tolerated: a broken request is the test's failure, not the zygote's
        print(f"zygote: bad request: {e}", file=sys.stderr)
        conn.close()
        return None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sock in (*others, conn):
                sock.close()
            os.close(ready_r)
            code = _run_child(request, fds, ready_w)
        finally:
            os._exit(code)
    for fd in (*fds, ready_w):
        os.close(fd)
    with contextlib.suppress(OSError):  # the child became the command (or died: its status follows)
        select.select([ready_r], [], [], 60)
    os.close(ready_r)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # tolerated: the test is gone
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def _run_child(request: dict, fds: list[int], ready: int) -> int:
    _become_command(request, fds)
    os.close(ready)  # the zygote answers the test with this pid only now: title, environment, cwd are set

    def as_module() -> None:  # what `python -m` runs: `main()`, its return value ignored
        importlib.import_module(request["module"]).main()

    return run_to_exit(as_module)


def _become_command(request: dict, fds: list[int]) -> None:
    """Turn this fresh fork of the zygote into the command's process (the module invariants)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    forget_parent_state()
    os.environ["SPT_NOENV"] = "1"
    import setproctitle

    setproctitle.setproctitle(" ".join([sys.executable, "-m", request["module"], *request["argv"]]))
    os.chdir(request["cwd"])
    # as a fresh interpreter's: the working directory (`-m`), the command's PYTHONPATH, then the rest
    sys.path[:] = [request["cwd"], *_pythonpath(request["env"]), *_BASE_PATH]
    os.environ.clear()
    os.environ.update(request["env"])
    _show_environment(request["env"])
    sys.argv = [importlib.util.find_spec(request["module"]).origin, *request["argv"]]  # as `-m` sets it
    sys.modules["numpy"].random.seed()
    sys.modules["torch"].seed()


def _show_environment(env: dict[str, str]) -> None:
    """Write `env` over this process's initial environment block, which `/proc/<pid>/environ` shows (the
    tests find a run's processes by a marker there) and which `rl`'s own forked components inherit. The
    block is the zygote's, started with `_ENV_ROOM` bytes to spare; nothing points into it any more once
    `os.environ` was replaced (libc's `setenv` copies the new strings)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51 of proc(5))
    block = b"".join(f"{key}={value}".encode() + b"\0" for key, value in env.items())
    if len(block) > end - start:
        raise RuntimeError(f"the environment ({len(block)} bytes) does not fit the zygote's ({end - start})")
    ctypes.memmove(start, block + b"\0" * (end - start - len(block)), end - start)


if __name__ == "__main__":
    serve(sys.argv[1])
