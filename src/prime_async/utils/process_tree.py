"""Process trees on Linux: find every descendant of a process and end them all, whatever their session.

Used by `launcher/process.py` (stopping one component), `launcher/rl.py` (the final sweep of `rl`) and
`inference/sglang_launcher.py` (SGLang's server, scheduler and detokenizer).

Why a tree walk and not only `killpg`: a component may start children in a new session (SGLang's launcher
does, so that it can stop them as a group), and such children are outside the component's process group.
When the component itself dies first, its children are re-parented: to the nearest *child subreaper*
(`become_subreaper()`), else to PID 1, where no walk from us can find them. So `rl` marks itself a
subreaper at start; then every process any component ever started stays a descendant of `rl` until it is
reaped, and `kill_tree(os.getpid())` at exit ends all of them.

Zombies count as gone: they hold no memory or GPU, and `subprocess.Popen` objects of the caller must
reap their own children (a blanket `waitpid(-1)` here would steal their exit statuses).

Invariant: `kill_tree(root)` returns only when every descendant of `root` that existed when it was called
(and every one they started meanwhile) is gone or a zombie, after SIGTERM, then SIGKILL at the timeout.
`root` itself is never signalled unless `include_root`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # tolerated: not Linux / no libc symbol; the tree walk still works
        return False


def become_subreaper() -> bool:
    """Orphans of our descendants are re-parented to us (Linux >= 3.4), so `descendants()` still sees them."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """`preexec_fn` for a child: receive `signum` when the process that started it dies (even by SIGKILL)."""
    _prctl(_PR_SET_PDEATHSIG, int(signum))


def _proc_stats() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgrp) of every process in /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # tolerated: the process exited while we looked
            continue
        # the command name (field 2) is in parentheses and may hold spaces: parse after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        yield int(entry.name), fields[0], int(fields[1]), int(fields[2])


def _parent_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, state, ppid, _ in _proc_stats():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    return children


def children(pid: int) -> list[int]:
    """Live (non-zombie) direct children of `pid`."""
    return _parent_map().get(pid, [])


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`. They outlive its leader: when a component's leader is
    killed (e.g. torchrun's agent, by SIGKILL), its workers are re-parented, out of the leader's tree,
    but stay in its group."""
    return [pid for pid, state, _, pgrp in _proc_stats() if state != "Z" and pgrp == pgid]


def descendants(root: int, *, also: tuple[int, ...] = ()) -> list[int]:
    """Live (non-zombie) descendants of `root`, parents before children; with `also`, those pids (when
    alive) and their descendants too (a snapshot taken earlier: re-parented orphans are not under `root`)."""
    children = _parent_map()
    out: list[int] = []
    frontier = [*children.get(root, []), *(p for p in also if alive(p))]
    while frontier:
        pid = frontier.pop(0)
        if pid in out or pid == root:
            continue
        out.append(pid)
        frontier.extend(children.get(pid, []))
    return out


def alive(pid: int) -> bool:
    """True when `pid` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next((line for line in status.splitlines() if line.startswith("State:")), "State: X")
    return "Z" not in state.split()[1]


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        # Tolerated: the process may exit between the walk and the signal.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def kill_tree(
    root: int,
    *,
    timeout_s: float,
    include_root: bool = False,
    also: tuple[int, ...] = (),
    exclude: frozenset[int] = frozenset(),
) -> list[int]:
    """SIGTERM `root`'s descendants (and `root` if asked), SIGKILL what is left after `timeout_s`.

    `also`: pids found under `root` earlier (see `descendants`). `exclude`: pids to leave alone.
    Returns the pids that needed SIGKILL.
    """

    def targets() -> list[int]:
        pids = [p for p in descendants(root, also=also) if p not in exclude]
        return [root, *pids] if include_root and alive(root) else pids

    # Children started after the first SIGTERM get one too; a pid is signalled once (SGLang logs each one).
    signalled: set[int] = set()

    def terminate_new() -> list[int]:
        left = targets()
        _signal_all([p for p in left if p not in signalled], signal.SIGTERM)
        signalled.update(left)
        return left

    terminate_new()
    deadline = time.monotonic() + timeout_s
    while terminate_new() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = targets()
    if left:
        logger.warning("processes %s did not stop within %.0f s: killing them", left, timeout_s)
        _signal_all(left, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while targets() and time.monotonic() < deadline:
            time.sleep(0.05)
    return left
