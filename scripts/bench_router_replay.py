"""The tiny MoE run (configs/tiny/rl_moe.toml) with and without routing replay, in each pause mode,
side by side: step-0 mismatch KL, mean mismatch KL over the run, routing agreement, reward, wall time.

Usage:
    uv run python scripts/bench_router_replay.py                      # 3 pause modes x replay on/off
    uv run python scripts/bench_router_replay.py --dtype bfloat16 --steps 12

Each run is a real `rl` (embedded engine, orchestrator, fsdp trainer) on the tiny Qwen3-MoE model; the
figures are read from each run's `metrics/trainer.jsonl` and `metrics/orchestrator.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(out: Path, *, replay: bool, pause_mode: str, steps: int, dtype: str) -> dict:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl_moe.toml"),
        "--output-dir", str(out), "--router-replay", str(replay).lower(), "--weights.pause-mode", pause_mode,
        "--max-steps", str(steps), "--model.dtype", dtype,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    trainer = _rows(out / "metrics" / "trainer.jsonl")
    orch = _rows(out / "metrics" / "orchestrator.jsonl")
    agreement = [r["moe/routing_agreement"] for r in trainer if "moe/routing_agreement" in r]
    return {
        "kl0": trainer[0]["mismatch_kl"],
        "kl_mean": statistics.fmean(r["mismatch_kl"] for r in trainer),
        "agreement": statistics.fmean(agreement) if agreement else None,
        "reward": statistics.fmean(r["reward/mean"] for r in orch[-3:]),
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", help="model.dtype of every component")
    ap.add_argument("--pause-modes", nargs="+", default=["retract", "in_place", "drain"])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router_replay_"))
    print(f"tiny MoE, {args.steps} steps, model.dtype {args.dtype}; runs in {work}")
    print(f"{'pause mode':<10} {'replay':<7} {'step-0 KL':>10} {'mean KL':>10} {'agreement':>10} "
          f"{'reward (last 3)':>16} {'wall s':>7}")  # fmt: skip
    for mode in args.pause_modes:
        for replay in (True, False):
            out = work / f"{mode}_{replay}"
            r = run(out, replay=replay, pause_mode=mode, steps=args.steps, dtype=args.dtype)
            if "error" in r:
                print(f"{mode:<10} {replay!s:<7} FAILED: {r['error']}")
                continue
            agreement = "-" if r["agreement"] is None else f"{r['agreement']:.4f}"
            print(f"{mode:<10} {replay!s:<7} {r['kl0']:>10.2e} {r['kl_mean']:>10.2e} {agreement:>10} "
                  f"{r['reward']:>16.3f} {r['wall']:>7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
