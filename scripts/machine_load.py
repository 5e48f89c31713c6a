"""The load on this machine from processes other than ours: the guard of the benchmarks.

A benchmark's speed-up ratios compare runs that share the machine's cores with their own engine, trainer
and orchestrator; a test suite running beside one of them makes its steps slower and the ratios wrong
(the agentic benchmark's headline figures were once taken that way). This module measures the CPU time
that every process outside the benchmark's own tree (the benchmark process and all its descendants, i.e.
the `rl` run it started) used, from /proc alone (Linux; no dependency):

- per process: `utime + stime` of `/proc/<pid>/stat` (all its threads), plus what it reaped from children
  that started and ended between two samples (`cutime + cstime`, less what was already counted of the
  children seen alive); processes are keyed by (pid, start time), so a reused pid is a new process, and a
  process once seen in our tree stays ours when it is re-parented;
- the machine: the busy jiffies of `/proc/stat` (user, nice, system, irq, softirq, steal); what neither
  our tree nor the processes shown account for (interrupts, steal, the processes of another PID namespace:
  `hidden`, ~0 on a quiet machine) counts as the others'.

`measure(seconds)` is the short sample before a run (1 s sub-samples); `LoadSampler` is the background
thread during a run (a sample every `interval` s, 1.5 by default). `judge` decides on either.

Threshold (`MEAN_LIMIT_CORES`, `PEAK_CORES`, `PEAK_SECONDS`): the machine is loaded when the other processes
used more than 0.25 of one core on average over the window, or more than 0.8 of a core in every sample of
a stretch of at least 5 s. Why: an idle machine's other processes (kernel threads, the sandbox's agent)
use ~0.01 core, one busy process 1 core; on the 2 cores the benchmark's runs share, 0.25 core is 12% of
the machine, about what separates the step times of neighbouring K, so a smaller load cannot move a ratio
by as much as the table resolves, while a larger one can. The sustained rule catches a burst (a test
run beside one K for a few steps) that a long run's mean would average away; 5 s is about one step.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MEAN_LIMIT_CORES = 0.25
PEAK_CORES = 0.8
PEAK_SECONDS = 5.0
TOP = 20  # processes kept in a report
NAMED = 5  # processes named in its line
TICK = float(os.sysconf("SC_CLK_TCK"))
PROC = Path("/proc")

Key = tuple[int, int]  # (pid, start time in ticks since boot)


@dataclass(frozen=True)
class Proc:
    """One process of a /proc snapshot: CPU ticks of its own and of the children it reaped."""

    pid: int
    ppid: int
    comm: str
    ticks: int
    child_ticks: int


def parse_stat(text: str) -> tuple[Key, Proc]:
    """(key, Proc) of one `/proc/<pid>/stat` line (the command name may hold spaces and parentheses)."""
    head, _, rest = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    fields = rest.split()  # fields[0] is the state (field 3 of proc(5))
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    pid = int(pid_text)
    proc = Proc(pid, int(fields[1]), comm, utime + stime, cutime + cstime)
    return (pid, int(fields[19])), proc


def snapshot() -> dict[Key, Proc]:
    """Every process /proc shows now (one that ends while being read is left out)."""
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                key, proc = parse_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            out[key] = proc
    return out


def machine_busy_ticks() -> int:
    """Busy ticks of all CPUs since boot: user + nice + system + irq + softirq + steal (`/proc/stat`)."""
    values = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return user + nice + system + irq + softirq + steal


def tree(root: int, procs: dict[Key, Proc]) -> set[Key]:
    """The keys of `root` and all its descendants in `procs`."""
    children: dict[int, list[Key]] = {}
    for key, proc in procs.items():
        children.setdefault(proc.ppid, []).append(key)
    pids = {key[0]: key for key in procs}
    out, todo = set(), [pids[root]] if root in pids else []
    while todo:
        key = todo.pop()
        out.add(key)
        todo.extend(children.get(key[0], []))
    return out


@dataclass
class Sample:
    """One interval: its length, and the core-seconds used in it by the others (per process), by our
    tree (per process) and by the whole machine."""

    seconds: float
    others: dict[str, float] = field(default_factory=dict)  # "pid comm" -> core-seconds
    own: dict[str, float] = field(default_factory=dict)
    machine: float = 0.0

    @property
    def hidden(self) -> float:
        """Core-seconds of the machine that no process shown here accounts for (interrupts, steal, the
        processes of another PID namespace): counted as the others'."""
        return max(0.0, self.machine - sum(self.others.values()) - sum(self.own.values()))

    @property
    def other_cores(self) -> float:
        return (sum(self.others.values()) + self.hidden) / max(self.seconds, 1e-9)


def interval_deltas(prev: dict[Key, Proc], cur: dict[Key, Proc]) -> dict[Key, float]:
    """Core-seconds each process of `cur` used since `prev`: its own ticks, plus the ticks it reaped from
    children, less the children's ticks already counted while they were alive (module docstring)."""
    gone = {key[0]: proc for key, proc in prev.items() if key not in cur}
    counted: dict[int, int] = {}  # live pid -> ticks of its vanished descendants counted before
    for proc in gone.values():
        reaper = proc.ppid  # the nearest live ancestor: a vanished parent's total went up to it
        while reaper in gone and reaper != gone[reaper].ppid:
            reaper = gone[reaper].ppid
        counted[reaper] = counted.get(reaper, 0) + proc.ticks + proc.child_ticks
    out = {}
    for key, proc in cur.items():
        before = prev.get(key)
        own = proc.ticks - (before.ticks if before else 0)
        reaped = proc.child_ticks - (before.child_ticks if before else 0) - counted.get(proc.pid, 0)
        out[key] = (max(own, 0) + max(reaped, 0)) / TICK
    return out


class Sampler:
    """Successive samples of the load, our tree being `root` and its descendants (sticky: a process once
    seen in the tree stays ours)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self._procs = snapshot()
        self._own = tree(self.root, self._procs)
        self._busy, self._t = machine_busy_ticks(), time.monotonic()

    def sample(self) -> Sample:
        """The sample of the interval since the last call (or since construction)."""
        procs, busy, now = snapshot(), machine_busy_ticks(), time.monotonic()
        self._own |= tree(self.root, procs)
        out = Sample(seconds=now - self._t, machine=(busy - self._busy) / TICK)
        for key, used in interval_deltas(self._procs, procs).items():
            if used > 0:
                side = out.own if key in self._own else out.others
                name = f"{key[0]} {procs[key].comm}"
                side[name] = side.get(name, 0.0) + used
        self._procs, self._busy, self._t = procs, busy, now
        return out


@dataclass
class LoadReport:
    """The verdict on a window of samples (`judge`)."""

    seconds: float
    other_cores: float  # mean
    own_cores: float
    machine_cores: float
    hidden_core_s: float  # machine time no shown process accounts for (part of other_cores)
    peak_seconds: float  # the longest stretch of samples with the others above PEAK_CORES
    loaded: bool
    reason: str
    others_top: list[tuple[int, str, float]]  # (pid, command, core-seconds), largest first
    own_top: list[tuple[int, str, float]]
    samples: list[float]  # the others' cores per sample

    def culprits(self) -> str:
        """`pid 123 (pytest) 41.2 core-s, ...`: what took the cores."""
        named = [f"pid {pid} ({comm}) {used:.1f} core-s" for pid, comm, used in self.others_top[:NAMED]]
        if self.hidden_core_s >= 0.05 * self.seconds:
            named.append(f"no process shown (interrupts, steal, hidden) {self.hidden_core_s:.1f} core-s")
        return ", ".join(named) or "nothing"

    def to_dict(self) -> dict[str, Any]:
        """For JSON (`from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadReport:
        data = dict(data)
        for name in ("others_top", "own_top"):
            data[name] = [tuple(item) for item in data[name]]
        return cls(**data)


def _top(samples: list[Sample], side: str) -> list[tuple[int, str, float]]:
    """The TOP processes of one side ("others" / "own") by core-seconds over the samples."""
    total: dict[str, float] = {}
    for sample in samples:
        for name, used in getattr(sample, side).items():
            total[name] = total.get(name, 0.0) + used
    ranked = sorted(total.items(), key=lambda item: -item[1])[:TOP]
    return [
        (int(name.split(" ", 1)[0]), name.split(" ", 1)[1], used) for name, used in ranked if used >= 0.05
    ]


def longest_peak(samples: list[Sample], cores: float = PEAK_CORES) -> float:
    """Seconds of the longest stretch of consecutive samples whose others used more than `cores`."""
    best = run = 0.0
    for sample in samples:
        run = run + sample.seconds if sample.other_cores > cores else 0.0
        best = max(best, run)
    return best


def judge(samples: list[Sample]) -> LoadReport:
    """The verdict on a window: loaded when the others' mean exceeds MEAN_LIMIT_CORES or they stayed above
    PEAK_CORES for PEAK_SECONDS in a row (module docstring)."""
    seconds = sum(s.seconds for s in samples) or 1e-9
    hidden = sum(s.hidden for s in samples)
    others = (sum(sum(s.others.values()) for s in samples) + hidden) / seconds
    peak = longest_peak(samples)
    reason = ""
    if others > MEAN_LIMIT_CORES:
        reason = f"other processes used {others:.2f} cores on average over {seconds:.0f} s (limit "
        reason += f"{MEAN_LIMIT_CORES})"
    elif peak >= PEAK_SECONDS:
        reason = f"other processes used more than {PEAK_CORES} core for {peak:.0f} s in a row (limit "
        reason += f"{PEAK_SECONDS:.0f} s)"
    return LoadReport(
        seconds=seconds, other_cores=others, peak_seconds=peak, loaded=bool(reason), reason=reason,
        own_cores=sum(sum(s.own.values()) for s in samples) / seconds,
        machine_cores=sum(s.machine for s in samples) / seconds,
        hidden_core_s=hidden, others_top=_top(samples, "others"), own_top=_top(samples, "own"),
        samples=[round(s.other_cores, 3) for s in samples],
    )  # fmt: skip


def measure(seconds: float = 3.0, step: float = 1.0, root: int | None = None) -> LoadReport:
    """The load of the next `seconds` (the check before a run), in samples of `step` seconds."""
    sampler, samples = Sampler(root), []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(step, left))
        samples.append(sampler.sample())
    return judge(samples)


class LoadSampler:
    """The background sampler during a run: `with LoadSampler() as load: run(); report = load.report`."""

    def __init__(self, interval: float = 1.5, root: int | None = None) -> None:
        self.interval, self.samples = interval, []
        self._sampler = Sampler(root)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)
        self.report: LoadReport | None = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self._sampler.sample())

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._sampler.sample())  # the last, partial interval
        self.report = judge(self.samples)


def load_averages() -> str:
    """`load average: 0.12, 0.30, 0.25 (1, 5, 15 min; 2 cores)`, as `uptime` prints it."""
    one, five, fifteen = (PROC / "loadavg").read_text().split()[:3]
    return f"load average: {one}, {five}, {fifteen} (1, 5, 15 min; {os.cpu_count()} cores)"


def describe(report: LoadReport) -> str:
    """One line: the others', ours and the machine's cores, and the verdict."""
    verdict = f"LOADED: {report.reason}; {report.culprits()}" if report.loaded else "quiet"
    return (f"{report.seconds:.0f} s: others {report.other_cores:.2f} cores (peak stretch "
            f"{report.peak_seconds:.0f} s), ours {report.own_cores:.2f}, machine {report.machine_cores:.2f}: "
            f"{verdict}")  # fmt: skip


if __name__ == "__main__":
    print(load_averages())
    print(describe(measure(3.0)))
