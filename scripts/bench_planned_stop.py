"""Generated tokens lost by a planned stop of the orchestrator, before and after carrying the work over.

    uv run python scripts/bench_planned_stop.py [--only demo,word-chain] [--out outputs/bench-planned-stop]

Each case runs `rl` (restarts allowed), sends SIGTERM to the orchestrator once `--at-step` steps are
logged, lets `rl` restart it alone and finish, then reads the resumed lifetime's `resume/*` metrics:

    carried   sampled tokens of the pending groups the planned stop saved (finished episodes, recorded
              turns of the running ones): what a restart lost before this work, all of it
    reused    tokens the resumed lifetime took over: finished episodes kept, turns answered from the
              record (replayed), the cut turn continued
    lost      carried - reused: tokens newer than the served version (discarded), or of groups that aged
              past K, or of turns whose replay missed

Cases: the demo (echo-text, SmolLM2, single-turn) and word-chain against the scripted opponent on the tiny
model (multi-turn: three model calls per episode).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from prime_async.utils.monitor import read_jsonl

# name: (config, steps, SIGTERM after this many steps, extra flags)
CASES = {
    "demo": ("configs/echo_text/rl.toml", 10, 4, []),
    "word-chain": ("configs/tiny/rl_word_chain.toml", 8, 3, [
        "--orchestrator.max_off_policy_steps", "1", "--orchestrator.admission.max_buffered_groups", "4",
        "--weights.pause_mode", "retract",
    ]),
}  # fmt: skip


def _orchestrator_pid(out: Path) -> int | None:
    needle = str(out / "configs" / "orchestrator")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            except OSError:
                continue
            if f"@ {needle}" in " ".join(cmd):  # exec'd `.../orchestrator @ <config>`, or a fork's title
                return int(entry.name)
    return None


def run_case(name: str, out_root: Path, timeout_s: float) -> dict[str, float]:
    config, steps, at_step, extra = CASES[name]
    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "prime_async.entrypoints.rl", "@", config, *extra,
           "--output_dir", str(out / "run"), "--max_steps", str(steps), "--wandb.enabled", "false",
           "--restart.max_restarts", "1",
           "--inference.server.port", "0", "--transport.port", "0"]  # fmt: skip
    with open(out / "rl.stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline, sent = time.monotonic() + timeout_s, False
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: rl did not finish in {timeout_s:.0f}s (see {out})")
            rows = read_jsonl(out / "run" / "metrics" / "orchestrator.jsonl")
            if not sent and len(rows) >= at_step and (pid := _orchestrator_pid(out / "run")):
                os.kill(pid, signal.SIGTERM)
                sent = True
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: rl exited {proc.returncode} (see {out}/rl.stderr)")
    resumed = [
        m for m in read_jsonl(out / "run" / "metrics" / "orchestrator.jsonl") if "resume/carried_tokens" in m
    ]
    if not resumed:
        raise RuntimeError(f"{name}: no resumed lifetime logged resume/* metrics (see {out})")
    last = resumed[-1]
    reused = (
        last["resume/replayed_tokens"]
        + last["resume/continued_tokens"]
        + last["resume/reused_finished_tokens"]
    )
    return {
        "carried": last["resume/carried_tokens"], "reused": reused,
        "replayed": last["resume/replayed_tokens"],
        "continued": last["resume/continued_tokens"], "finished": last["resume/reused_finished_tokens"],
        "discarded": last["resume/discarded_tokens"], "groups": last["resume/carried_groups"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-planned-stop"))
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    results = {name: run_case(name, args.out, args.timeout_s) for name in args.only.split(",")}
    print("| case | carried groups | lost before (all carried tokens) | reused: finished / replayed / "
          "continued "
          "| lost after | lost after / before |\n|---|---|---|---|---|---|")  # fmt: skip
    for name, r in results.items():
        lost = r["carried"] - r["reused"]
        share = lost / r["carried"] if r["carried"] else 0.0
        print(f"| {name} | {r['groups']:.0f} | {r['carried']:.0f} | {r['finished']:.0f} / "
              f"{r['replayed']:.0f} / "
              f"{r['continued']:.0f} | {lost:.0f} | {share:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
