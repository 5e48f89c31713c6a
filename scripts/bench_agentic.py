"""The agentic benchmark: per workload, sync (K = 0) against async (K = 1, 2, 4), side by side in one call.

Usage:
    uv run python scripts/bench_agentic.py                       # lookup_agent and echo_long, K = 0 1 2 4
    uv run python scripts/bench_agentic.py --workloads echo_long --ks 0 2 --steps 12 [rl overrides]
    uv run python scripts/bench_agentic.py --orchestrator.data.seed 1 --inference.engine.seed 1 \\
        --out-dir outputs/bench_agentic_seed1                    # another seed
    uv run python scripts/bench_agentic.py --sglang              # engines on real SGLang (CPU)
    uv run python scripts/bench_agentic.py --report-only         # the tables again, from the last runs
    uv run python scripts/bench_agentic.py --guard-only 5        # only the load guard, around a 5 s stand-in

A workload `NAME` is `configs/NAME/rl.toml` (skipped with a note while that file does not exist; `--config
PATH` runs one config as workload `PATH`'s folder name); its runs go to `OUT_DIR/NAME/k<K>`. Each K runs
`rl` to completion on the same config with `--orchestrator.max-off-policy-steps K` only (the admission
buffer follows K by default: `(K + 1) * batch_groups`; pass `--orchestrator.admission.max-buffered-groups N`
to pin it); other arguments go to `rl` as they are.

The load guard (`machine_load.py`, threshold in its docstring): before each run a 3 s sample, during it a
sample every 1.5 s, of the CPU time of every process outside this benchmark's own process tree. When the
other processes used more than 0.25 core on average, or more than 0.8 core for 5 s in a row, the benchmark
stops with exit status 3 and one line on stderr naming them (pid, command, core-seconds), and prints no
ratio; `--allow-loaded` prints the tables anyway under "LOADED MACHINE: ratios not trustworthy". Each run
keeps its verdict in `k<K>/bench_load.json`, which `--report-only` judges again (runs made before the guard
have none and say so). The header gives the load averages (as `uptime`).

Printed per workload:

  episodes     the length distribution of every finished episode of the workload's runs
               (`metrics/episodes.jsonl`): turns, tokens (prompt + completion), wall seconds, p50/p90/p99/max
  per K        step (s): mean orchestrator step time after step 0; speed-up: the sync run's step / this
               one's; bound: the workload's throughput bound (below); gain90 ratio (below); reward last:
               mean of the last `--window` steps +- its standard error; engine busy: mean
               `engine/busy_fraction`; discarded: the share of the generated loss tokens
               (`ledger/tokens/generated`) that ended masked at the cut as older than K (`masked_stale`),
               in groups dropped as stale, cancelled, filtered or errored (`ledger/tokens/<reason>`, the
               last orchestrator row; "-" in runs that predate the token ledger); prompts lost: issued and
               never trained (`ledger/prompts_lost`); length bias: the last `rollout/length_bias` and its
               cluster-robust low bound (`rollout/length_bias/low`); token staleness: `n - v` of the trained
               loss tokens (`rollout/token_staleness/mean`, weighted by each step's trained tokens; max)
  details      trainer idle: waiting-for-batch / trainer wall time; trainer (s): mean `time/train +
               time/publish_weights`; group staleness: share of trained groups at staleness 0, 1, ...;
               dropped / cancelled groups (`ledger/dropped_stale`, `ledger/cancelled / ledger/dispatched`);
               reward first; gain90 (s); auc and its ratio; load: the others' cores before / during the run
  time to reward  two robust definitions, each as a ratio to the sync run:
               gain90: wall time until the run's smoothed reward (trailing `--window` mean) first reaches
                       the sync run's first-window reward + 90% of the sync run's gain (< 1: faster);
               auc:    the mean reward over [0, T], T = the shortest run's wall time (> 1: better)
  reward curve  each run's per-step reward

The throughput bound is the speed-up a perfect overlap of generation and training could give: the sync
run's step time / max(generation s per step, trainer compute s per step), both measured in the sync run
(generation = mean `engine/busy_fraction` x step time; trainer compute = mean `time/train +
time/publish_weights`). It is an estimate: on shared cores the engine and the trainer slow each other down
once they overlap, so the real bound is lower; it is "-" without a busy fraction (SGLang).

Exits 1 when a run fails, 3 when the machine is loaded. The figures of one call are noisy (one seed): the
speed-up is a ratio of means over steps of the same call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import run_rl
from compare_runs import RunMetrics, load_run, smoothed
from machine_load import (
    MEAN_LIMIT_CORES,
    PEAK_CORES,
    PEAK_SECONDS,
    LoadReport,
    LoadSampler,
    describe,
    load_averages,
    measure,
)

ROOT = Path(__file__).resolve().parents[1]
SGLANG_FLAGS = ["@", str(ROOT / "configs/tiny/rl_sglang_cpu.toml")]  # the slow tests' SGLang-on-CPU flags
WORKLOADS = ["lookup_agent", "echo_long"]
LOAD_FILE = "bench_load.json"
LOADED_EXIT = 3
LOADED_LINE = "LOADED MACHINE: ratios not trustworthy"
PRE_SECONDS = 3.0
TOKEN_REASONS = ("masked_stale", "dropped_stale", "cancelled", "filtered", "errored")
# the stand-in of `--guard-only`: a child that starts a grandchild burning one core (our own tree)
BURN = (
    "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass"
)
STAND_IN = (
    f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN!r}, sys.argv[1]], check=True)"
)


@dataclass
class KResult:
    """One run's figures (`summarize`)."""

    k: int
    run: RunMetrics
    episodes: list[dict]
    step_s: float
    engine_busy: float | None
    trainer_idle: float
    trainer_s: float
    staleness: dict[int, float]
    token_staleness: tuple[float, float] | None  # (token-weighted mean, max)
    tokens: dict[str, float]  # ledger/tokens/<state> of the last row (empty before the token ledger)
    dropped: float
    cancelled_share: float
    prompts_lost: float
    length_bias: float | None
    length_bias_low: float | None
    wall_s: float
    load: dict[str, LoadReport] = field(default_factory=dict)  # "before" / "during"


# -- the load guard ------------------------------------------------------------------------------------


def refuse(where: str, phase: str, report: LoadReport) -> NoReturn:
    """The one line on stderr, then exit LOADED_EXIT."""
    print(f"bench_agentic: machine loaded {phase} {where}: {report.reason}; took the cores: "
          f"{report.culprits()}; no ratios printed (--allow-loaded prints them, marked)",
          file=sys.stderr, flush=True)  # fmt: skip
    raise SystemExit(LOADED_EXIT)


def guarded(where: str, run: Callable[[], object], record: Path, allow_loaded: bool) -> dict[str, LoadReport]:
    """`run()` between the check before it and the sampler during it; the verdicts go to `record`. Refuses
    (`refuse`) on a loaded machine unless `allow_loaded`."""
    before = measure(PRE_SECONDS)
    print(f"load before {where}: {describe(before)}", flush=True)
    if before.loaded and not allow_loaded:
        refuse(where, "before", before)
    with LoadSampler() as sampler:
        run()
    assert sampler.report is not None
    print(f"load during {where}: {describe(sampler.report)}", flush=True)
    loads = {"before": before, "during": sampler.report}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({phase: r.to_dict() for phase, r in loads.items()}, indent=1) + "\n")
    if sampler.report.loaded and not allow_loaded:
        refuse(where, "during", sampler.report)
    return loads


def read_loads(run_dir: Path) -> dict[str, LoadReport]:
    """The verdicts a guarded run left (none for runs made before the guard)."""
    path = run_dir / LOAD_FILE
    if not path.exists():
        return {}
    return {phase: LoadReport.from_dict(data) for phase, data in json.loads(path.read_text()).items()}


def check_loads(runs: dict[str, list[KResult]], allow_loaded: bool) -> None:
    """`--report-only`: refuse on the first loaded verdict, note the runs without one."""
    unmeasured = [f"{name} K = {r.k}" for name, results in runs.items() for r in results if not r.load]
    if unmeasured:
        print(f"load not measured for {', '.join(unmeasured)} (runs made before the load guard)")
    for name, results in runs.items():
        for r in results:
            for phase, report in r.load.items():
                if report.loaded and not allow_loaded:
                    refuse(f"{name} K = {r.k}", phase, report)


def guard_only(seconds: float, out_dir: Path, allow_loaded: bool) -> None:
    """The guard around a `seconds`-long stand-in of our own (a grandchild burning one core), no rl run."""
    stand_in = [sys.executable, "-c", STAND_IN, str(seconds)]
    loads = guarded("the stand-in", lambda: subprocess.run(stand_in, check=True), out_dir / LOAD_FILE,
                    allow_loaded)  # fmt: skip
    if any(r.loaded for r in loads.values()):
        print(LOADED_LINE)


# -- the figures of one run ----------------------------------------------------------------------------


def quantiles(values: list[float]) -> tuple[float, float, float, float]:
    """p50, p90, p99 and max (nearest rank)."""
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)]

    return q(0.5), q(0.9), q(0.99), ordered[-1]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file ([] when it does not exist)."""
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def group_staleness(run: RunMetrics) -> dict[int, float]:
    """The share of trained groups at each staleness, over the whole run."""
    groups: dict[int, float] = {}
    for r in run.orchestrator:
        for key, value in r.items():
            if key.startswith("rollout/data_staleness/ratio_"):
                s = int(key.rsplit("_", 1)[1])
                groups[s] = groups.get(s, 0.0) + value * r["rollout/trained_groups"]
    total = sum(groups.values()) or 1.0
    return {s: n / total for s, n in sorted(groups.items())}


def token_staleness(run: RunMetrics) -> tuple[float, float] | None:
    """(mean over the trained loss tokens, max) of `rollout/token_staleness/*`; None before that metric."""
    rows = [r for r in run.orchestrator if "rollout/token_staleness/mean" in r]
    if not rows:
        return None
    weights = [float(r.get("rollout/trained_completion_tokens", 1.0)) for r in rows]
    total = sum(weights) or 1.0
    mean = sum(w * r["rollout/token_staleness/mean"] for w, r in zip(weights, rows, strict=True)) / total
    return mean, max(float(r.get("rollout/token_staleness/max", 0.0)) for r in rows)


def summarize(k: int, run_dir: Path) -> KResult:
    """The figures of the run in `run_dir` (means over the steps after step 0; ledgers of the last row)."""
    run = load_run(run_dir)
    orch = [r for r in run.orchestrator if r["step"] >= 1] or run.orchestrator
    busy = [r["engine/busy_fraction"] for r in orch if "engine/busy_fraction" in r]
    trainer = [r for r in run.trainer if r["step"] >= 1] or run.trainer
    waited = sum(r["time/wait_for_batch"] for r in trainer)
    worked = [r["time/train"] + r.get("time/publish_weights", 0.0) for r in trainer]
    last = max(run.orchestrator, key=lambda r: r["step"])
    tokens = {
        key.removeprefix("ledger/tokens/"): v for key, v in last.items() if key.startswith("ledger/tokens/")
    }
    return KResult(
        k=k, run=run, episodes=read_jsonl(run_dir / "metrics" / "episodes.jsonl"),
        step_s=statistics.fmean(r["time/step"] for r in orch),
        engine_busy=statistics.fmean(busy) if busy else None,
        trainer_idle=waited / max(waited + sum(worked), 1e-9),
        trainer_s=statistics.fmean(worked) if worked else 0.0,
        staleness=group_staleness(run), token_staleness=token_staleness(run), tokens=tokens,
        dropped=last.get("ledger/dropped_stale", 0.0),
        cancelled_share=last.get("ledger/cancelled", 0.0) / max(last.get("ledger/dispatched", 0.0), 1.0),
        prompts_lost=last.get("ledger/prompts_lost", 0.0),
        length_bias=last.get("rollout/length_bias"), length_bias_low=last.get("rollout/length_bias/low"),
        wall_s=max(run.wall_clock().values()), load=read_loads(run_dir),
    )  # fmt: skip


def rewards(run: RunMetrics) -> tuple[list[float], list[float]]:
    """(wall-clock end of each step, reward/mean of each step), in step order."""
    clock = run.wall_clock()
    steps, values = run.series("orchestrator", "reward/mean")
    order = sorted(range(len(steps)), key=steps.__getitem__)
    return [clock[steps[i]] for i in order], [values[i] for i in order]


def time_to_gain(run: RunMetrics, target: float, window: int) -> float | None:
    """Wall time at which the trailing `window` mean reward first reaches `target` (None: never)."""
    times, values = rewards(run)
    return next((t for t, v in zip(times, smoothed(values, window), strict=True) if v >= target), None)


def reward_auc(run: RunMetrics, horizon: float) -> float:
    """Mean of the step-wise reward curve over [0, horizon] (each step's reward holds from its end on; the
    time before the first step counts as that step's reward)."""
    times, values = rewards(run)
    area, last_t, last_v = 0.0, 0.0, values[0]
    for t, v in zip(times, values, strict=True):
        if t >= horizon:
            break
        area += (t - last_t) * last_v
        last_t, last_v = t, v
    return (area + (horizon - last_t) * last_v) / horizon


# -- the tables ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """What every row of a workload is compared with: its sync run (else its first)."""

    sync: KResult
    start: float  # the sync run's first-window reward
    gain: float
    target: float  # gain90's
    sync_hit: float | None
    horizon: float  # auc's
    sync_auc: float
    bound: float | None  # the throughput bound

    @classmethod
    def of(cls, results: list[KResult], window: int) -> Reference:
        """The reference of a workload's runs, with its gain90 target, auc horizon and throughput bound."""
        sync = next((r for r in results if r.k == 0), results[0])
        _, values = rewards(sync.run)
        start = statistics.fmean(values[:window])
        gain = smoothed(values, window)[-1] - start
        target = start + 0.9 * gain
        horizon = min(r.wall_s for r in results)
        bound = None
        if sync.engine_busy is not None:
            bound = sync.step_s / max(sync.engine_busy * sync.step_s, sync.trainer_s, 1e-9)
        return cls(sync, start, gain, target, time_to_gain(sync.run, target, window), horizon,
                   reward_auc(sync.run, horizon), bound)  # fmt: skip


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    """`value` in `spec` and `unit`, "-" for None."""
    return "-" if value is None else format(value, spec) + unit


def _discarded(r: KResult, reason: str) -> str:
    """The share of the generated loss tokens that ended in `reason` ("-" without the token ledger)."""
    generated = r.tokens.get("generated")
    if not generated or reason not in r.tokens:
        return "-"
    return f"{r.tokens[reason] / generated:.1%}"


def last_reward(r: KResult, window: int) -> str:
    """Mean of the last `window` steps +- its standard error."""
    last = rewards(r.run)[1][-window:]
    err = statistics.stdev(last) / math.sqrt(len(last)) if len(last) > 1 else 0.0
    return f"{statistics.fmean(last):.3f} +- {err:.3f}"


def pareto_row(r: KResult, ref: Reference, window: int) -> list[str]:
    """The cells of one K's row of the per-K table."""
    hit = time_to_gain(r.run, ref.target, window)
    bias = _fmt(r.length_bias, ".2f")
    if r.length_bias is not None and r.length_bias_low is not None:
        bias += f" (low {r.length_bias_low:.2f})"
    stale = (
        "-" if r.token_staleness is None else f"{r.token_staleness[0]:.2f} (max {r.token_staleness[1]:.0f})"
    )
    return [
        str(r.k), f"{r.step_s:.2f}", f"{ref.sync.step_s / r.step_s:.2f}x", _fmt(ref.bound, ".2f", "x"),
        "-" if hit is None or not ref.sync_hit else f"{hit / ref.sync_hit:.2f}x",
        last_reward(r, window), _fmt(r.engine_busy, ".2f"),
        *(_discarded(r, reason) for reason in TOKEN_REASONS),
        f"{r.prompts_lost:.0f}", bias, stale,
    ]  # fmt: skip


def print_pareto(name: str, results: list[KResult], ref: Reference, window: int) -> None:
    """The per-K table of one workload, with how its throughput bound and gain90 target were made."""
    sync = ref.sync
    gen = None if sync.engine_busy is None else sync.engine_busy * sync.step_s
    bound = _fmt(ref.bound, ".2f", "x")
    print(f"\n{name}: per K, against K = {sync.k}; throughput bound {bound} = sync step {sync.step_s:.2f} s "
          f"/ max(generation {_fmt(gen, '.2f')} s, trainer {sync.trainer_s:.2f} s) "
          f"(an estimate on shared cores); gain90 target {ref.target:.3f} (sync first {window} "
          f"{ref.start:.3f} + 0.9 x gain {ref.gain:.3f}); discarded: % of generated loss tokens")  # fmt: skip
    print("| K | step (s) | speed-up | bound | gain90 ratio | reward last | engine busy | masked stale "
          "| dropped stale | cancelled | filtered | errored | prompts lost | length bias (low) "
          "| token staleness (max) |")  # fmt: skip
    print("|" + "---|" * 15)
    for r in results:
        print("| " + " | ".join(pareto_row(r, ref, window)) + " |")


def print_details(name: str, results: list[KResult], ref: Reference, window: int) -> None:
    """The other per-K figures: trainer, group staleness and ledger, reward first, gain90 (s), auc, load."""
    print(f"\n{name}: details; auc over the first {ref.horizon:.0f} s")
    print("| K | trainer idle | trainer (s) | group staleness 0/1/2/.. | dropped groups | cancelled groups "
          "| reward first | gain90 (s) | auc | auc ratio | load before/during (cores) |")  # fmt: skip
    print("|" + "---|" * 11)
    for r in results:
        hit, auc = time_to_gain(r.run, ref.target, window), reward_auc(r.run, ref.horizon)
        load = "/".join(f"{r.load[p].other_cores:.2f}" for p in ("before", "during") if p in r.load) or "-"
        cells = [
            str(r.k), f"{r.trainer_idle:.2f}", f"{r.trainer_s:.2f}",
            "/".join(f"{r.staleness.get(s, 0.0):.2f}" for s in range(max(r.staleness, default=0) + 1)),
            f"{r.dropped:.0f}", f"{r.cancelled_share:.1%}",
            f"{statistics.fmean(rewards(r.run)[1][:window]):.3f}", _fmt(hit, ".0f"),
            f"{auc:.3f}", f"{auc / ref.sync_auc:.2f}x" if ref.sync_auc else "-", load,
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def print_episodes(name: str, results: list[KResult]) -> None:
    """The length distribution of the finished episodes of all of a workload's runs."""
    episodes = [e for r in results for e in r.episodes if e.get("status") == "ok"]
    print(f"\n{name}: episode lengths ({len(episodes)} episodes of {len(results)} runs)")
    print("| measure | p50 | p90 | p99 | max |\n|---|---|---|---|---|")
    for key, fmt in (("turns", "{:.0f}"), ("tokens", "{:.0f}"), ("seconds", "{:.2f}")):
        values = [float(e[key]) for e in episodes if e.get(key) is not None]
        if values:
            print(f"| {key} | " + " | ".join(fmt.format(v) for v in quantiles(values)) + " |")


def print_workload(name: str, results: list[KResult], window: int) -> None:
    """The tables of one workload, under the LOADED line when a run of it was measured loaded."""
    loaded = [(r.k, phase, rep) for r in results for phase, rep in r.load.items() if rep.loaded]
    print(f"\n## {name}")
    for k, phase, report in loaded:
        print(f"{LOADED_LINE} ({name} K = {k}, {phase}: {report.reason}; {report.culprits()})")
    ref = Reference.of(results, window)
    print_episodes(name, results)
    print_pareto(name, results, ref, window)
    print_details(name, results, ref, window)
    print(f"\n{name}: reward curves (per step)")
    for r in results:
        print(f"K = {r.k}: " + " ".join(f"{v:.2f}" for v in rewards(r.run)[1]))
    if loaded:
        print(LOADED_LINE)


# -- the runs ------------------------------------------------------------------------------------------


def workloads(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, config) of each workload to run or report; a missing config is skipped with a note."""
    if args.config is not None:
        return [(args.config.resolve().parent.name, args.config)]
    out = []
    for name in args.workloads:
        config = ROOT / "configs" / name / "rl.toml"
        if config.exists() or args.report_only:
            out.append((name, config))
        else:
            print(f"skipping workload {name}: {config} does not exist (yet)")
    return out


def collect(name: str, config: Path, args: argparse.Namespace, extra: list[str]) -> list[KResult]:
    """Run (unless `--report-only`) and summarize each K of one workload."""
    if args.report_only and not (args.out_dir / name).is_dir():
        print(f"skipping workload {name}: no runs in {args.out_dir / name}")
        return []
    results = []
    for k in args.ks:
        run_dir = args.out_dir / name / f"k{k}"
        if not args.report_only:
            flags = ["--wandb.name", f"{name}-k{k}", *(SGLANG_FLAGS if args.sglang else [])]
            run = partial(run_rl, config, run_dir, args.steps, k, [*flags, *extra])
            guarded(f"{name} K = {k}", run, run_dir / LOAD_FILE, args.allow_loaded)
        elif not (run_dir / "metrics").is_dir():
            print(f"skipping {name} K = {k}: no run in {run_dir}")
            continue
        results.append(summarize(k, run_dir))
    return results


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's arguments, and the rest (passed to `rl`)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, help="configs/<name>/rl.toml each")
    parser.add_argument("--config", type=Path, default=None, help="one config instead of --workloads")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: the config's)")
    parser.add_argument("--window", type=int, default=4, help="steps of the reward windows and smoothing")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "outputs/bench_agentic")
    parser.add_argument("--sglang", action="store_true", help="engines on real SGLang (CPU)")
    parser.add_argument("--report-only", action="store_true", help="only the tables, from --out-dir's runs")
    parser.add_argument(
        "--allow-loaded", action="store_true", help="print the tables on a loaded machine too"
    )
    parser.add_argument("--guard-only", type=float, default=None, metavar="SECONDS",
                        help="only the load guard, around a SECONDS-long stand-in (verdicts in "
                        "OUT_DIR/bench_load.json)")  # fmt: skip
    return parser.parse_known_args()


def main() -> None:
    """Run or re-read every workload's runs under the load guard, then print each workload's tables."""
    args, extra = parse_args()
    print(f"bench_agentic: {load_averages()}; the load guard refuses when other processes use more than "
          f"{MEAN_LIMIT_CORES} core on average or {PEAK_CORES} core for {PEAK_SECONDS:.0f} s in a row",
          flush=True)  # fmt: skip
    if args.guard_only is not None:
        guard_only(args.guard_only, args.out_dir, args.allow_loaded)
        return
    runs = {name: collect(name, config, args, extra) for name, config in workloads(args)}
    runs = {name: results for name, results in runs.items() if results}
    if not runs:
        raise SystemExit("bench_agentic: no workload to report")
    if args.report_only:
        check_loads(runs, args.allow_loaded)
    for name, results in runs.items():
        print_workload(name, results, args.window)


if __name__ == "__main__":
    main()
