"""The feature-interaction matrix: which combinations of options train, and which are refused at start.

    DIMENSIONS ──► refused pairs: every pair of values (the rest at their defaults) validated by the real
                   `RLConfig`; a pair it refuses is a refusal cell (exit 2, one line naming both keys)
               ──► trained cells: an all-pairs covering set (allpairspy) of every other pair, each cell a
                   whole `rl` run on the tiny model (the default buffer at every K), checked against
                   counts the orchestrator's group table did not make (`check_trained`): its steps
                   trained; `ledger/trained` = the trajectories the trainer counted in what it received,
                   the finished ones all in the episode log; staleness in [0, K] per group and per token
                   (from the wire's versions, none unknown); nothing cancelled, stale or lost outside kill
                   cells; a teacher's logprobs in every batch; replayed routes in every trainer step; the
                   kill the only restart; no process of the run left afterwards; CURVE keys generated
                   owner-only and used by every component; the weight probe's figures within their
                   thresholds; no health alarm on these healthy runs (`stop_on_alarm` cells); images in
                   every trained batch of a vlm cell (the tiny VLM on image-shapes); an elastic cell's
                   engine (`rl-engines add`, then `remove`) serving between (1 -> 2 -> 1 engines per
                   step), or its `add` refused in one line where the pool refuses changes
               ──► not crossed: the pairs that break the TIE (env = image_shapes exactly with model = vlm)

Adding an option: its values in DIMENSIONS (the default first), its config in `_base_config` (one
value) or a function in OPTION_SECTIONS (a section), its check called by `check_trained`, and how a
refusal line names it in `test_matrix.py: KEY_WORDS`.

Used by `test_matrix.py` (CI: every cell), `test_matrix_doc.py` (the docs table lists exactly these
cells) and `scripts/feature_matrix.py` (runs the cells, writes `docs/feature-matrix.md`).

Invariants: the cell set is a pure function of DIMENSIONS and the config schema (no randomness:
allpairspy is deterministic); every pair of values of two dimensions is either in some trained cell, a
refused pair, or breaks the TIE; a cell's whole `rl` config is `cell_config(cell, ...)`, nothing else
(an elastic cell's engine commands are the run's, in `run_cell`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_engines import ELASTIC_STEPS, ENGINES_TIMEOUT_S, Engine, change_engines, start_engine_before

import zygote

ROOT = Path(__file__).resolve().parents[2]

# The values of each option the matrix crosses; the first value of each is its default in a cell.
DIMENSIONS: dict[str, list[Any]] = {
    # image_shapes: the image-shapes environment, tied to model = vlm (TIE)
    "env": ["single_turn", "multi_turn", "tools", "two_seats", "best_of_n", "higher_lower", "image_shapes"],
    "kill": ["none", "inference", "trainer", "orchestrator"],
    "k": [1, 0, 3, 8],
    "pause_mode": ["retract", "in_place", "drain"],
    "eval": ["off", "shared", "dedicated"],
    "weights": ["filesystem", "distributed"],
    "lora": ["off", "on"],
    "envs": ["one", "mix"],
    "deterministic": ["off", "on"],
    "interval": [1, 2],
    "granularity": ["sample", "group"],
    "trainer_procs": [1, 2],
    "moe": ["off", "replay"],  # replay: the tiny Qwen3-MoE model with router_replay (R3)
    "teacher": ["off", "on"],  # on: on-policy distillation, the student's initial model as teacher
    "curve": ["auto", "on"],  # transport.curve: on = ZeroMQ CURVE on the batch stream and control channel
    "probe": ["off", "on"],  # weights.probe.enabled: the check after every weight load
    "stop_on_alarm": ["off", "on"],  # trainer.health.stop_on_alarm: a health alarm ends the run
    "model": ["tiny", "vlm"],  # vlm: model.build = "tiny_vlm" (docs/vlm.md), trained on image-shapes (TIE)
    "elastic": ["off", "on"],  # on: `rl-engines add`, then `remove`, of an engine (elastic_engines.py)
}
# A cell has env = image_shapes exactly when it has model = vlm: the vlm cells train on images (two per
# episode, as configs/tiny/rl_vlm.toml), the text model cannot. The pairs that break the tie are not crossed.
TIE = (("env", "image_shapes"), ("model", "vlm"))
DEFAULTS = {name: values[0] for name, values in DIMENSIONS.items()}

# verifiers environments of each kind (the project's own examples, and verifiers' best-of-n env);
# higher_lower: the env answers between turns, as `uv run new-env higher-lower --multi-turn` writes it
ENVS: dict[str, dict[str, Any]] = {
    "single_turn": {"id": "reverse-text", "args": {"num_examples": 64}},
    "multi_turn": {"id": "word-chain", "name": "word-chain-vs-script",
                   "config": {"opponent": "script", "rounds": 2}},
    "tools": {"id": "calculator-tools", "args": {"num_examples": 16}},
    "two_seats": {"id": "word-chain", "config": {"rounds": 1}},
    "best_of_n": {"id": "reverse-text", "name": "reverse-text-best-of-2", "args": {"num_examples": 64},
                  "config": {"id": "best-of-n", "n": 2}},
    "higher_lower": {"id": "higher-lower", "args": {"num_examples": 64}},
    "image_shapes": {"id": "image-shapes", "args": {"num_examples": 64, "turns": 2}},
}  # fmt: skip
MIX_PARTNER = {"id": "calculator", "name": "mix-calculator", "args": {"num_examples": 32}}
EVAL_ENV = {"id": "reverse-text", "name": "heldout", "args": {"num_examples": 4, "seed": 123}}
STEPS, KILL_STEPS, KILL_AT = 4, 6, 2  # a kill lands once KILL_AT orchestrator steps are logged


Cell = dict[str, Any]


def cell_config(cell: Cell, *, out: str = "outputs/matrix", model_dir: str = "models/tiny",
                ports: tuple[int, int, int] = (30000, 5557, 30100)) -> dict[str, Any]:  # fmt: skip
    """The whole `rl` config of `cell` (a TOML document as a dict): the base run, then each option's
    section (`OPTION_SECTIONS`, one small function per option that is more than a value in the base)."""
    cfg = _base_config(cell, out=out, model_dir=model_dir, ports=ports)
    for add_section in OPTION_SECTIONS:
        add_section(cell, cfg, ports)
    return cfg


def _base_config(cell: Cell, *, out: str, model_dir: str, ports: tuple[int, int, int]) -> dict[str, Any]:
    """The run every cell shares, with the options that are one value each set from `cell`."""
    inference_port, transport_port, _ = ports
    envs = [ENVS[cell["env"]]] + ([MIX_PARTNER] if cell["envs"] == "mix" else [])
    # max_buffered_groups is left at its default, (K + 1) * batch_groups, at every K
    orchestrator: dict[str, Any] = {
        "batch_groups": 2, "group_size": 2, "max_off_policy_steps": cell["k"],
        "admission": {"submission_granularity": cell["granularity"]}, "sampling": {"max_tokens": 8},
        "envs": envs,
    }  # fmt: skip
    return {
        "max_steps": num_steps(cell),
        "seq_len": 1024,  # the tools env's prompt with its tool schemas is ~500 tokens
        "output_dir": out,
        "model": _model(cell, model_dir),
        "router_replay": cell["moe"] == "replay",
        "wandb": {"enabled": False},
        "transport": {"port": transport_port, "curve": cell["curve"]},
        "inference": {"server": {"port": inference_port}, "engine": {"max_running_requests": 8}},
        "orchestrator": orchestrator,
        "trainer": {
            "optim": {"lr": 1e-4},
            "num_processes": cell["trainer_procs"],
            "health": {"stop_on_alarm": cell["stop_on_alarm"] == "on"},
        },
        "deterministic": cell["deterministic"] == "on",
        # 0: rl picks a free rendezvous port, so two cells running at once never meet on the default one
        "weights": {
            "transport": cell["weights"],
            "master_port": 0,
            "pause_mode": cell["pause_mode"],
            "update_interval": cell["interval"],
            "probe": {"enabled": cell["probe"] == "on"},
        },
    }


def num_steps(cell: Cell) -> int:
    """The cell's `max_steps`: more with a kill (steps after the restart), most with an elastic engine."""
    if cell["elastic"] == "on":
        return ELASTIC_STEPS
    return STEPS if cell["kill"] == "none" else KILL_STEPS


def _model(cell: Cell, model_dir: str) -> dict[str, str]:
    """The tiny model, its MoE sibling (moe = replay), or the tiny VLM (model = vlm; with replay the
    config refuses the dense VLM)."""
    if cell["model"] == "vlm":
        return {"path": sibling_model_dir(model_dir, "vlm"), "build": "tiny_vlm"}
    if cell["moe"] == "replay":
        return {"path": moe_model_dir(model_dir), "build": "tiny_moe"}
    return {"path": model_dir, "build": "tiny"}


def _lora_section(cell: Cell, cfg: dict[str, Any], ports: tuple[int, int, int]) -> None:
    if cell["lora"] == "on":
        cfg["lora"] = {"rank": 4, "alpha": 8.0}


def _teacher_section(cell: Cell, cfg: dict[str, Any], ports: tuple[int, int, int]) -> None:
    if cell["teacher"] == "on":  # rl serves the teacher on an engine of its own (a free port)
        teacher = {"model": cfg["model"]["path"], "kl_weight": 0.5, "env_weight": 1.0}
        cfg["orchestrator"]["teacher"] = teacher


def _eval_section(cell: Cell, cfg: dict[str, Any], ports: tuple[int, int, int]) -> None:
    if cell["eval"] != "off":
        cfg["orchestrator"]["eval"] = {"envs": [EVAL_ENV], "interval": 2, "placement": cell["eval"]}
    if cell["eval"] == "dedicated":
        cfg["eval_inference"] = {"server": {"port": ports[2]}, "engine": {"max_running_requests": 8}}


def _kill_section(cell: Cell, cfg: dict[str, Any], ports: tuple[int, int, int]) -> None:
    if cell["kill"] != "none":
        cfg["restart"] = {"max_restarts": 1, "backoff_s": 0.5}
        cfg["trainer"]["ckpt"] = {"interval": 2}
        cfg["orchestrator"]["data"] = {"ckpt": {"interval": 1}}


def _elastic_section(cell: Cell, cfg: dict[str, Any], ports: tuple[int, int, int]) -> None:
    # the engine started before `rl` reports the run's id (elastic_engines.py)
    if cell["elastic"] == "on":
        cfg["run_id"] = "matrix-elastic-" + hashlib.sha1(cell_id(cell).encode()).hexdigest()[:12]


# the sections of options that add more than one value to the base config, applied in this order
OPTION_SECTIONS = (_lora_section, _teacher_section, _eval_section, _kill_section, _elastic_section)


def moe_model_dir(model_dir: str) -> str:
    """The tiny MoE model beside the tiny model (`rl` builds it on first use, atomically)."""
    return sibling_model_dir(model_dir, "moe")


def sibling_model_dir(model_dir: str, kind: str) -> str:
    """A tiny model of another kind (moe, vlm) beside the tiny model (`rl` builds it on first use)."""
    return str(Path(model_dir).with_name(Path(model_dir).name + "-" + kind))


@functools.cache
def _refusal(items: tuple[tuple[str, Any], ...]) -> str | None:
    import logging

    from pydantic import ValidationError

    from prime_async.config.rl import RLConfig

    quiet = logging.getLogger("prime_async.config")
    level, quiet.level = quiet.level, logging.ERROR  # validation warnings are the cells' runs' to print
    try:
        RLConfig.model_validate(cell_config(dict(items)))
    except (ValueError, ValidationError) as e:
        return " ".join(str(e).split())
    finally:
        quiet.setLevel(level)
    return None


def refusal(cell: Cell) -> str | None:
    """Why config validation refuses `cell` (its error text), or None when it would train."""
    return _refusal(tuple(sorted({**DEFAULTS, **cell}.items())))


@dataclass(frozen=True)
class RefusedPair:
    """Two values that cannot train together (everything else at its default)."""

    a: tuple[str, Any]
    b: tuple[str, Any]
    message: str

    @property
    def cell(self) -> Cell:
        return tied({**DEFAULTS, self.a[0]: self.a[1], self.b[0]: self.b[1]})

    @property
    def label(self) -> str:
        return f"{self.a[0]}={self.a[1]} x {self.b[0]}={self.b[1]}"


def tied(cell: Cell) -> Cell:
    """`cell` with the TIE's other value set when it holds one of them (a pair's cell: the rest defaults)."""
    (d1, v1), (d2, v2) = TIE
    if cell[d1] == v1:
        return {**cell, d2: v2}
    return {**cell, d1: v1} if cell[d2] == v2 else cell


def keeps_tie(cell: Cell) -> bool:
    """Whether `cell` (possibly partial) holds both values of the TIE or neither."""
    (d1, v1), (d2, v2) = TIE
    return d1 not in cell or d2 not in cell or (cell[d1] == v1) == (cell[d2] == v2)


def untied_pairs() -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    """The pairs the matrix does not cross: they break the TIE (a text env on the VLM, images to the text
    model)."""
    return [(a, b) for a, b in all_pairs() if not keeps_tie(dict([a, b]))]


def all_pairs() -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    """Every pair of values of two different dimensions."""
    out = []
    for (d1, v1s), (d2, v2s) in itertools.combinations(DIMENSIONS.items(), 2):
        out += [((d1, v1), (d2, v2)) for v1 in v1s for v2 in v2s]
    return out


@functools.cache
def refused_pairs() -> tuple[RefusedPair, ...]:
    """The pairs config validation refuses, in DIMENSIONS order."""
    assert refusal(DEFAULTS) is None, f"the default cell is refused: {refusal(DEFAULTS)}"
    out = []
    for a, b in all_pairs():
        if not keeps_tie(dict([a, b])):
            continue
        message = refusal(tied({**DEFAULTS, a[0]: a[1], b[0]: b[1]}))
        if message is not None:
            out.append(RefusedPair(a, b, message))
    return tuple(out)


@functools.cache
def trained_cells() -> tuple[tuple[tuple[str, Any], ...], ...]:
    """An all-pairs covering set of the pairs that are not refused; every cell validates."""
    from allpairspy import AllPairs

    names = list(DIMENSIONS)

    def allowed(row: list[Any]) -> bool:
        partial = dict(zip(names, row, strict=False))
        return keeps_tie(partial) and refusal(partial) is None

    rows = [dict(zip(names, row, strict=True)) for row in AllPairs([DIMENSIONS[n] for n in names],
                                                                   filter_func=allowed)]  # fmt: skip
    refused = {(p.a, p.b) for p in refused_pairs()} | set(untied_pairs())
    for a, b in all_pairs():  # allpairspy's filtered search can leave allowed pairs uncovered
        if (a, b) not in refused and not any(r[a[0]] == a[1] and r[b[0]] == b[1] for r in rows):
            rows.append(_cover(a, b, rows, refused))
    return tuple(tuple(row.items()) for row in rows)


def _cover(a: tuple[str, Any], b: tuple[str, Any], rows: list[Cell], refused: set) -> Cell:
    """A valid cell holding pair (a, b), its other values chosen greedily to cover pairs not yet covered."""
    cell = tied({**DEFAULTS, a[0]: a[1], b[0]: b[1]})
    for name, values in DIMENSIONS.items():
        if name in (a[0], b[0]) or name in dict(TIE):
            continue

        def gain(value: Any, name: str = name) -> int:
            trial = {**cell, name: value}
            return sum(not any(r[name] == value and r[o] == trial[o] for r in rows)
                       for o in DIMENSIONS if o != name)  # fmt: skip

        for value in sorted(values, key=gain, reverse=True):
            if keeps_tie({**cell, name: value}) and refusal({**cell, name: value}) is None:
                cell[name] = value
                break
    return cell


SHORT = {"single_turn": "single-turn", "multi_turn": "multi-turn", "two_seats": "two seats",
         "best_of_n": "best-of-n", "higher_lower": "higher-lower", "filesystem": "fs",
         "distributed": "dist", "image_shapes": "image-shapes"}  # fmt: skip


def table_values(cell: Cell) -> list[str]:
    """The cell's values as the docs table writes them, in DIMENSIONS order."""
    return [SHORT.get(str(cell[name]), str(cell[name])) for name in DIMENSIONS]


def cell_id(cell: Cell) -> str:
    """A short name of the cell's non-default values (pytest id, docs row)."""
    parts = [f"{k}={v}" for k, v in cell.items() if v != DEFAULTS[k]]
    return ",".join(parts) or "defaults"


# ------------------------------------------------------------------------------------------- running


@dataclass
class CellRun:
    """What one `rl` run of a cell did."""

    cell: Cell
    out: Path
    model_path: str = ""
    returncode: int = 0
    stderr: str = ""
    wall_s: float = 0.0
    killed_pid: int = 0
    leftovers: list[str] = field(default_factory=list)
    # the `rl-engines` commands of an elastic cell: (op, exit status, output, orchestrator steps logged after)
    engine_changes: list[tuple[str, int, str, int]] = field(default_factory=list)
    engine: Engine | None = None  # an elastic cell's engine, started before `rl`


def run_cell(cell: Cell, work: Path, *, model_dir: Path, timeout_s: float) -> CellRun:
    """Run `rl` on the cell's config (written to `work/cell.toml`), with its kill, and report; every
    process of the run (its tree while `rl` lived, or the run's marker in its environment) still alive
    once `rl` exited is reported in `leftovers`, then ended."""
    import tomli_w

    out = work / "run"
    ports = (0, 0, 0)  # rl picks free ones as it starts (a port picked here could be taken by then)
    path = work / "cell.toml"
    config = cell_config(cell, out=str(out), model_dir=str(model_dir), ports=ports)
    run = CellRun(cell=cell, out=out, model_path=config["model"]["path"])
    path.write_text(tomli_w.dumps(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           RUN_MARKER: str(out)}  # fmt: skip
    stop = threading.Event()
    seen: dict[int, str] = {}  # pid -> start time of every process seen in rl's tree
    start = time.monotonic()
    run.engine = start_engine_before(config, work, env) if cell["elastic"] == "on" else None
    with (work / "rl.stdout").open("wb") as out_file, (work / "rl.stderr").open("wb") as err_file:
        proc = zygote.popen([sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(path)], cwd=ROOT,
                            env=env, stdout=out_file, stderr=err_file)  # fmt: skip
    threads = [threading.Thread(target=_kill_at, args=(run, stop), daemon=True),
               threading.Thread(target=_watch_tree, args=(proc.pid, seen, stop), daemon=True),
               threading.Thread(target=_change_engines, args=(run, env, stop), daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        run.stderr = _stderr_of(proc, work / "rl.stderr", timeout_s)
    finally:
        stop.set()
        for thread in threads:  # an `rl-engines` command ends within ENGINES_TIMEOUT_S
            thread.join(ENGINES_TIMEOUT_S + 30)
    run.wall_s = time.monotonic() - start
    run.returncode = proc.returncode
    run.leftovers = leftover_processes(out, seen)
    _end(run.leftovers)
    return run


def _stderr_of(proc: zygote.Process, stderr: Path, timeout_s: float) -> str:
    """`proc`'s stderr once it exited; past `timeout_s` it gets SIGTERM (`rl` then ends its components),
    SIGKILL 60 s later, and the stderr says it timed out."""
    try:
        proc.wait(timeout_s)
        return stderr.read_text(errors="replace")
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return f"{stderr.read_text(errors='replace')}\n[matrix] rl timed out after {timeout_s:.0f} s"


RUN_MARKER = "PRIME_ASYNC_MATRIX_RUN"  # in the environment of every process of a cell's run: its output dir


def _start_time(pid: int) -> str | None:
    """The start time of `pid` (field 22 of /proc/pid/stat), which tells it from a later process that
    reuses the pid; None once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # tolerated: the process exited
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] == "Z" else fields[19]


def _watch_tree(root: int, seen: dict[int, str], stop: threading.Event) -> None:
    """Record every descendant of `root` (`rl`, a subreaper: orphans stay under it while it lives) until
    `stop`, every 0.1 s."""
    from prime_async.utils.process_tree import descendants

    while not stop.is_set():
        for pid in descendants(root):
            started = _start_time(pid)
            if started is not None:
                seen.setdefault(pid, started)
        stop.wait(0.1)


def leftover_processes(out: Path, seen: dict[int, str]) -> list[str]:
    """'pid cmdline' of every live process of the run in `out`: seen in `rl`'s tree (same pid and start
    time), or carrying the run's marker in its environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        started = _start_time(pid)
        if started is None:
            continue
        ours = seen.get(pid) == started
        if not ours:
            with contextlib.suppress(OSError):  # tolerated: gone, or another user's process
                ours = f"{RUN_MARKER}={out}\0".encode() in (entry / "environ").read_bytes()
        if ours:
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
                found.append(f"{pid} {cmd[:200]}")
    return found


def _end(leftovers: list[str]) -> None:
    """SIGKILL the reported leftovers (processes of this run only), so later cells start clean."""
    for line in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def _kill_at(run: CellRun, stop: threading.Event) -> None:
    """SIGKILL the cell's component once KILL_AT orchestrator steps are logged (restarts are on)."""
    from proc_helpers import read_jsonl

    component = run.cell["kill"]
    if component == "none":
        return
    metrics = run.out / "metrics" / "orchestrator.jsonl"
    while not stop.is_set():
        pids = processes_of(run.out, component)
        if len(read_jsonl(metrics)) >= KILL_AT and pids:
            run.killed_pid = int(pids[0].split()[0])
            os.kill(run.killed_pid, signal.SIGKILL)
            return
        stop.wait(0.05)


def processes_of(out: Path, component: str) -> list[str]:
    """'pid cmdline' of every live process of `component` of the run in `out` (the kill's target),
    matched by its config file `out/configs/<component>.toml`."""
    needle = str(out / "configs" / f"{component}.toml")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # tolerated: the process exited while we looked
            continue
        if f"@ {needle}" in " ".join(cmd):  # exec'd `.../orchestrator @ <config>`, or a fork's title
            found.append(f"{entry.name} {' '.join(cmd)[:200]}")
    return found


def _change_engines(run: CellRun, env: dict[str, str], stop: threading.Event) -> None:
    if run.engine is not None:  # elastic_engines.py: the engine started before rl, added, removed, stopped
        change_engines(run.out, run.engine, stop, run.engine_changes)


def check_trained(run: CellRun) -> dict[str, float]:
    """Assert that the run trained its steps correctly; returns figures for the docs table."""
    from proc_helpers import read_jsonl

    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run.out / "logs").glob("*.log"))
    )
    assert run.returncode == 0, f"rl exited {run.returncode}:\n{run.stderr[-3000:]}\n{logs}"
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    steps = num_steps(run.cell)
    k = run.cell["k"]
    orch = read_jsonl(run.out / "metrics" / "orchestrator.jsonl")
    trainer = read_jsonl(run.out / "metrics" / "trainer.jsonl")
    episodes = read_jsonl(run.out / "metrics" / "episodes.jsonl")
    assert sorted({m["step"] for m in orch}) == list(range(steps)), [m["step"] for m in orch]
    assert sorted({m["step"] for m in trainer}) == list(range(steps)), [m["step"] for m in trainer]
    for m in orch:
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in LEDGER_STATES), m
        assert m["rollout/data_staleness/min"] >= 0 and m["rollout/token_staleness/max"] <= k, m
    check_ledger(orch, trainer, episodes, steps)
    check_no_waste(run.cell, orch)
    check_offpolicy(run.cell, trainer, num_steps_per_batch(run.out))
    check_teacher(run.cell, orch)
    check_router_replay(run.cell, trainer)
    check_kill(run)
    check_curve(run)
    check_probe(run, orch)
    check_health(run, trainer)
    check_images(run.cell, orch)
    check_vlm_errors(run)
    check_elastic(run, orch)
    return {
        "wall_s": run.wall_s,
        "staleness_max": max(m["rollout/data_staleness/max"] for m in orch),
        "trained": orch[-1]["ledger/trained"],
        "errored": orch[-1]["ledger/errored"],
    }


LEDGER_STATES = ("inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled")
FINISHED_STATES = ("buffered", "trained", "dropped_stale", "filtered", "errored")  # reached the sink


def last_lifetime(orch: list[dict]) -> list[dict]:
    """The orchestrator rows of its last lifetime (its ledger counts from that lifetime's start): the
    trailing rows cut by the lifetime that cut the last batch, steps rising."""
    start = orch[-1]["batch/lifetime_start"]
    i = len(orch) - 1
    while i > 0 and orch[i - 1]["batch/lifetime_start"] == start and orch[i - 1]["step"] < orch[i]["step"]:
        i -= 1
    return orch[i:]


def check_ledger(orch: list[dict], trainer: list[dict], episodes: list[dict], steps: int) -> None:
    """The orchestrator's `ledger/*` against counts that owe nothing to its group table:
    - trained: after each batch n of the last lifetime, `ledger/trained` is the sum of `loss/num_samples`
      (trajectories with a loss token, counted by the trainer in the rows it received) over the batches
      of that lifetime up to n; the trainer's row of a step is its last (a restarted trainer re-logs);
    - finished: every trajectory that reached the sink (trained, buffered, dropped, filtered) has its line
      in `metrics/episodes.jsonl`, written by the dispatcher when its group finished; trained ones are ok."""
    rows = last_lifetime(orch)
    start = rows[0]["step"]
    assert [m["step"] for m in rows] == list(range(start, steps)), [m["step"] for m in orch]
    by_step = {m["step"]: m for m in trainer}  # the last row of each step
    received = 0.0
    for m in rows:
        t = by_step[m["step"]]
        assert t["batch/lifetime_start"] == m["batch/lifetime_start"], (
            f"step {m['step']}: the trainer trained a batch of the lifetime started at "
            f"{t['batch/lifetime_start']}, the orchestrator's last lifetime started at {start}"
        )
        received += t["loss/num_samples"]
        assert m["ledger/trained"] == received, (
            f"step {m['step']}: ledger/trained {m['ledger/trained']:.0f}, but the trainer received "
            f"{received:.0f} trajectories in batches {start}..{m['step']}"
        )
    last = rows[-1]
    finished = sum(last[f"ledger/{b}"] for b in FINISHED_STATES)
    ok = sum(e["status"] == "ok" for e in episodes)
    assert len(episodes) >= finished, f"{len(episodes)} trajectories logged < {finished:.0f} finished"
    assert ok >= last["ledger/trained"], f"{ok} ok trajectories logged < {last['ledger/trained']:.0f} trained"


def check_no_waste(cell: Cell, orch: list[dict]) -> None:
    """Admission dispatches only what can ship (the default buffer, every K): nothing cancelled, nothing
    dropped stale, no prompt lost (in a vlm cell, only those of errored groups); a kill cell's restart
    may (a rollback cancels the work in flight)."""
    if cell["kill"] != "none":
        return
    last = orch[-1]
    for name in ("cancelled", "dropped_stale", "prompts_lost"):
        if name == "prompts_lost" and cell["model"] == "vlm":  # an errored group's (check_vlm_errors)
            assert last["ledger/prompts_lost"] <= last["ledger/errored"], last
            continue
        assert last[f"ledger/{name}"] == 0, f"ledger/{name} = {last[f'ledger/{name}']:.0f}: {last}"


def num_steps_per_batch(out: Path) -> int:
    """S = `optim.num_steps_per_batch` of the trainer as `rl` configured it (`out/configs/trainer.toml`)."""
    import tomllib

    from prime_async.config.trainer import OptimConfig

    optim = tomllib.loads((out / "configs" / "trainer.toml").read_text()).get("optim", {})
    return int(optim.get("num_steps_per_batch", OptimConfig().num_steps_per_batch))


def check_offpolicy(cell: Cell, trainer: list[dict], num_steps: int) -> None:
    """Per token, from the versions on the wire: every loss token was trained at most (K + 1) * S - 1
    optimizer steps after the weights that sampled it, and none has an unknown version."""
    from prime_async.config.trainer import max_effective_steps

    bound = max_effective_steps(cell["k"], num_steps)
    for m in trainer:
        assert m["offpolicy/effective_steps/max"] <= bound, (
            f"step {m['step']}: a token {m['offpolicy/effective_steps/max']:.0f} optimizer steps off-policy "
            f"> (K + 1) * S - 1 = {bound}"
        )
        assert m["offpolicy/unknown_version_tokens"] == 0, f"step {m['step']}: loss tokens without a version"


def check_teacher(cell: Cell, orch: list[dict]) -> None:
    """A teacher cell distils: every batch carries the teacher's logprobs on its loss tokens
    (`opd/teacher_logprob` < 0; 0 when they are missing), they are the student's own to within
    `OPD_KL_BOUND` (`opd/reverse_kl`: the teacher is the student's initial model, and a few steps at lr 1e-4
    barely move it), the teacher scored tokens and failed none. A cell without a teacher has no `opd/*`."""
    if cell["teacher"] == "off":
        assert not [k for m in orch for k in m if k.startswith(("opd/", "teacher/"))], orch[-1]
        return
    for m in orch:
        assert m["opd/teacher_logprob"] < 0, f"step {m['step']}: no teacher logprob in the batch: {m}"
        assert abs(m["opd/reverse_kl"]) < OPD_KL_BOUND, f"step {m['step']}: student and teacher disagree: {m}"
        if cell["model"] == "tiny":  # a vlm cell's: a sampled vision token (check_vlm_errors)
            assert m["teacher/errors"] == 0, f"step {m['step']}: {m['teacher/errors']:.0f} teacher errors"
    assert sum(m["teacher/tokens"] for m in orch) > 0, "the teacher scored no token"


# nats per loss token: at most ~0.012 seen (full fine-tune, 6 steps). A sanity bound only: the tiny model
# is near-uniform (logprobs ~ -6.9), so teacher logprobs of the wrong tokens would not always exceed it.
OPD_KL_BOUND = 0.1


def check_router_replay(cell: Cell, trainer: list[dict]) -> None:
    """A router-replay cell delivers the engine's routes to the trainer in every step
    (`moe/replayed_routes` > 0); a cell without replay delivers none."""
    if cell["moe"] == "off":
        assert not [m["step"] for m in trainer if "moe/replayed_routes" in m]
        return
    for m in trainer:
        assert m.get("moe/replayed_routes", 0) > 0, f"step {m['step']}: no route replayed: {m}"


def check_kill(run: CellRun) -> None:
    """A kill cell's kill landed and was the one restart of the run: no other component died and was
    restarted on its own budget."""
    restarts = re.findall(r"(\w+) exited with status (\S+): restart \d+/\d+", run.stderr)
    if run.cell["kill"] == "none":
        assert not restarts, f"a component died in a cell without a kill: {restarts}"
        return
    assert run.killed_pid, "the kill never landed"
    assert restarts == [(run.cell["kill"], "-9")], f"restarts {restarts}, expected the kill's alone"


def component_config(out: Path, component: str) -> dict[str, Any]:
    """The config `rl` wrote for `component` (`out/configs/<component>.toml`)."""
    import tomllib

    return tomllib.loads((out / "configs" / f"{component}.toml").read_text())


CURVE_LINE = "transport: CURVE on the batch stream and the control channel, keys in "  # rl's, on stderr


def check_curve(run: CellRun) -> None:
    """A CURVE cell: `rl` said CURVE is on and generated the keys into `output_dir/transport_keys` (the
    directory 0700, the four key files 0600), the orchestrator and the trainer ranks were pointed at
    them, and the orchestrator refused no peer (its own trainer ranks got in, across restarts too).
    An `auto` cell binds loopback: plain TCP, no keys."""
    from prime_async.transport.curve import KEYS_DIRNAME

    keys = run.out / KEYS_DIRNAME
    if run.cell["curve"] == "auto":
        assert not keys.exists() and CURVE_LINE not in run.stderr, "CURVE on in a loopback `auto` cell"
        return
    assert f"{CURVE_LINE}{keys}" in run.stderr, f"rl did not say CURVE is on:\n{run.stderr[-2000:]}"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700, oct(keys.stat().st_mode)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in keys.iterdir()}
    assert modes == dict.fromkeys(CURVE_KEY_FILES, 0o600), modes
    for component in ("orchestrator", "trainer"):
        transport = component_config(run.out, component)["transport"]
        assert (transport["curve"], transport["curve_keys_dir"]) == ("on", str(keys)), (component, transport)
    log = (run.out / "logs" / "orchestrator.log").read_text()
    assert "refused a peer" not in log, [line for line in log.splitlines() if "refused a peer" in line]


CURVE_KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
PROBE = ("weights/probe_max_abs_logprob_diff", "weights/probe_kl", "weights/probe_tv", "weights/probe_time_s")
PROBE_LINES = ("on the weight probe", "the weight probe could not be scored")  # its ERROR and WARNING


def check_probe(run: CellRun, orch: list[dict]) -> None:
    """A probe cell (full weights) checks the versions it loads: every `weights/probe_*` logged is within
    `weights.probe`'s thresholds and no mismatch is logged; outside kill cells, every row that loaded a
    version (but the last) has the figures in it or in the next row (the check runs after the load,
    concurrently with the batch that may cut the row) and no probe could not be scored. A kill cell may
    skip versions (a restarted orchestrator has no reference for those announced before it came up; a
    killed engine fails its probe). Versions loaded after the last row (a high K loads none before)
    show in no row. Without the probe, and in LoRA cells (the engines would score the base model,
    docs/weights.md), there is no `weights/probe_*`."""
    from prime_async.config.probe import WeightProbeConfig

    checked = [m for m in orch if PROBE[0] in m]
    if run.cell["probe"] == "off" or run.cell["lora"] == "on":
        assert not checked, f"weights/probe_* without the probe: {checked[0]}"
        return
    assert component_config(run.out, "trainer")["weights"]["probe"]["enabled"], "the trainer has no probe"
    lines = (run.out / "logs" / "orchestrator.log").read_text().splitlines()
    forbidden = PROBE_LINES if run.cell["kill"] == "none" else PROBE_LINES[:1]
    assert not [line for line in lines if any(s in line for s in forbidden)], "\n".join(lines[-40:])
    limits = WeightProbeConfig()
    for m in checked:
        figures = {k: m[k] for k in PROBE}
        assert figures[PROBE[0]] <= limits.max_logprob_diff, f"step {m['step']}: {figures}"
        assert figures[PROBE[1]] <= limits.max_kl and figures[PROBE[2]] <= limits.max_tv, figures
        assert figures[PROBE[3]] > 0, f"step {m['step']}: {figures}"
    if run.cell["kill"] == "none":
        late = [m["step"] for m, after in itertools.pairwise(orch)
                if m["weights/updates"] > 0 and PROBE[0] not in m and PROBE[0] not in after]  # fmt: skip
        assert not late, f"versions loaded at steps {late} were never checked by the weight probe"


def check_health(run: CellRun, trainer: list[dict]) -> None:
    """A `stop_on_alarm` cell's setting reached the trainer, and on these healthy tiny runs no alarm fired:
    every trainer step logged the six `health/<alarm>` at 0, no alarm WARNING, and the run ended normally
    (asserted by `check_trained`)."""
    from prime_async.health.watch import ALARMS

    if run.cell["stop_on_alarm"] == "off":
        return
    assert component_config(run.out, "trainer")["health"]["stop_on_alarm"] is True
    for m in trainer:
        alarms = {a: m.get(f"health/{a}") for a in ALARMS}
        assert alarms == dict.fromkeys(ALARMS, 0.0), f"step {m['step']}: health alarms {alarms}"
    log = (run.out / "logs" / "trainer.log").read_text()
    assert "health alarm" not in log, [line for line in log.splitlines() if "health alarm" in line]


def check_images(cell: Cell, orch: list[dict]) -> None:
    """A vlm cell's images reached the trained episodes: `rollout/images_per_episode` > 0 in every step
    that trained image-shapes groups (every step of a one-env cell; a mix cell's per-env count says),
    and some did; a text cell logs none."""
    key, groups = "rollout/images_per_episode", "rollout/env/image-shapes/trained_groups"
    if cell["model"] == "tiny":
        assert not [m["step"] for m in orch if key in m], f"images in a text cell: {orch[-1]}"
        return
    with_images = [m for m in orch if m.get(groups, 1) > 0]
    assert with_images, f"no step trained image-shapes: {orch[-1]}"
    for m in with_images:
        assert m.get(key, 0) > 0, f"step {m['step']}: no image in the trained episodes: {m}"


SAMPLED_VISION_TOKEN = "placeholder token"  # in each error of a vision token the policy sampled


def check_vlm_errors(run: CellRun) -> None:
    """A vlm cell's episode errors (one WARNING per distinct error) are all the documented one of a random
    VLM (docs/vlm.md, Refusals): a reply sampled an image or video pad, which the next turn's prompt, or
    the teacher scoring the episode, counts as a placeholder without an image."""
    if run.cell["model"] == "tiny":
        return
    lines = (run.out / "logs" / "orchestrator.log").read_text().splitlines()
    errors = [line for line in lines if "episode error [" in line]
    assert all(SAMPLED_VISION_TOKEN in line for line in errors), "\n".join(errors)


def elastic_refused(cell: Cell) -> bool:
    """Whether the run refuses `rl-engines add` (docs/elastic.md: filesystem weights, full weights only)."""
    return cell["weights"] != "filesystem" or cell["lora"] == "on"


def check_elastic(run: CellRun, orch: list[dict]) -> None:
    """An elastic cell: where the pool refuses changes, `add` exited 1, its first line the refusal
    naming the setting, and one engine served throughout; elsewhere `add` and `remove` exited 0 and
    `inference/engines` per step went 1 -> 2 -> 1. A cell without: no change, one engine."""
    counts = [m.get("inference/engines") for m in orch]
    changes = [(op, code) for op, code, _, _ in run.engine_changes]
    if run.cell["elastic"] == "off":
        assert not changes and set(counts) == {1}, (changes, counts)
        return
    if elastic_refused(run.cell):
        line = run.engine_changes[0][2].splitlines()[0] if changes else ""
        named = any(word in line for word in ("weights.transport", "LoRA"))
        assert changes == [("add", 1)] and "refused" in line and named, run.engine_changes
        assert set(counts) == {1}, f"engines per step {counts}"
        return
    assert changes == [("add", 0), ("remove", 0)], f"{run.engine_changes}; engines per step {counts}"
    first_two = counts.index(2) if 2 in counts else len(counts)
    assert counts[0] == 1 and 1 in counts[first_two:] and set(counts) == {1, 2}, f"engines per step {counts}"


def run_refused(cell: Cell, work: Path, *, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """The `rl` command on a refused cell: it must exit 2 with one line before starting anything."""
    import tomli_w

    path = work / "cell.toml"
    path.write_text(tomli_w.dumps(cell_config(cell, out=str(work / "run"))))
    return zygote.run([sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(path)], cwd=ROOT,
                      timeout=timeout_s)  # fmt: skip
