"""Cost of evaluation while training on the training step time: the same `rl` run without eval, with a
shared eval (on the training engines) and with a dedicated eval (a second embedded engine), side by side.

    uv run python scripts/bench_eval_overhead.py [--config configs/tiny/rl_mix.toml] [--steps 12]
        [--interval 2] [--modes none,shared,dedicated]

Each mode is one real `rl` run (inference, trainer, orchestrator processes; tiny model by default) with
the eval of the config every `--interval` versions plus versions 0 and `--steps`. Printed per mode: the
mean orchestrator step time over steps 1..N-1 (the wall time between two batches: what eval may slow
down), the trainer's mean train time, the wall time of the eval points, how many versions were
evaluated, and the whole run's wall time. On 2 CPU cores every process competes for the same cores, so a
dedicated engine costs compute too; on a GPU node it runs on devices of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", args.config, "--output-dir", str(out),
        "--max-steps", str(args.steps), "--inference.server.port", "0",
        "--transport.port", "0", "--orchestrator.eval.interval", str(args.interval),
    ]  # fmt: skip
    if args.model:
        cmd += ["--model.path", args.model]
    if mode == "none":
        cmd += ["--orchestrator.eval.envs", "[]"]
    elif mode == "dedicated":
        cmd += ["--orchestrator.eval.placement", "dedicated"]
        cmd += ["--eval-inference.server.port", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: rl exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    evals = read_jsonl(out / "metrics" / "eval.jsonl")
    return {
        "step_s": statistics.mean(m["time/step"] for m in orch[1:]),
        "train_s": statistics.mean(m["time/train"] for m in trainer[1:]),
        "eval_s": sum(m["eval/time"] for m in evals),
        "evals": float(len(evals)),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/tiny/rl_mix.toml"))
    parser.add_argument("--model", default=None, help="model.path override (e.g. an existing tiny model)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--modes", default="none,shared,dedicated")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, args, Path(tmp) / mode)
            print(f"{mode}: done in {results[mode]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    base = results.get("none", {}).get("step_s")
    header = ("eval", "step s", "vs none", "train s", "evals", "eval s", "wall s")
    print(f"{header[0]:<10}" + "".join(f"{h:>9}" for h in header[1:]))
    for mode, r in results.items():
        rel = f"{100 * (r['step_s'] / base - 1):+.0f}%" if base else "-"
        cells = (f"{r['step_s']:.2f}", rel, f"{r['train_s']:.2f}", f"{r['evals']:.0f}", f"{r['eval_s']:.1f}",
                 f"{r['wall_s']:.0f}")  # fmt: skip
        print(f"{mode:<10}" + "".join(f"{c:>9}" for c in cells))


if __name__ == "__main__":
    main()
