"""Trainer checkpoint save and load time, fsdp vs megatron, on the demo model, side by side in one run.

Usage:
    uv run python scripts/bench_checkpoints.py                       # SmolLM2-135M (built offline if missing)
    uv run python scripts/bench_checkpoints.py --model models/tiny --repeats 5

Each backend runs in its own process (the megatron one on CPU ranks, world size 1, which installs a torch
function mode the fsdp timings must not pay): it builds the backend the trainer builds, trains nothing
(checkpoint size does not depend on it: Adam state is allocated first), then saves `--repeats` checkpoints
and loads each, timing both with the wall clock. Printed: median seconds per save and per load, and the
checkpoint's size on disk. The megatron figures include dist_checkpointing's sharded write (a spawned
writer manager on the first save of a process, reported separately as `first save`).
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
DEMO_MODEL = ROOT / "models" / "smollm2-135m-instruct"


def _backend(kind: str, model: str, out: Path):
    import torch

    from prime_async.config.trainer import TrainerConfig
    from prime_async.trainer.train import build_backend

    cfg = TrainerConfig(
        backend=kind, model={"path": model, "dtype": "float32"}, output_dir=str(out), wandb={"enabled": False}
    )
    torch.set_num_threads(1)
    return build_backend(cfg, torch.device("cpu"), world_size=1)


def _allocate_adam_state(backend) -> None:
    """One zero-gradient optimizer step, so the checkpoint holds the Adam moments a real one holds."""
    if hasattr(backend, "ddp"):  # megatron: its distributed optimizer allocates them this way
        for opt in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer]):
            opt._init_optimizer_states_with_dummy_values()
        return
    for p in backend.model.parameters():
        p.grad = p.detach().new_zeros(p.shape)
    backend.optimizer.step()
    backend.optimizer.zero_grad(set_to_none=True)


def measure(kind: str, model: str, repeats: int) -> dict:
    """Runs inside the child process: save/load timings of one backend."""
    out = Path(tempfile.mkdtemp(prefix=f"ckpt_{kind}_"))
    backend = _backend(kind, model, out)
    _allocate_adam_state(backend)
    saves, loads = [], []
    for step in range(1, repeats + 2):
        start = time.perf_counter()
        backend.save_checkpoint(output_dir=out, step=step, keep=2)
        saves.append(time.perf_counter() - start)
        path = out / "checkpoints" / "trainer" / f"step_{step}"
        start = time.perf_counter()
        backend.load_checkpoint(path)
        loads.append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"first_save": saves[0], "save": statistics.median(saves[1:]), "load": statistics.median(loads),
            "size_mb": size / 2**20}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["fsdp", "megatron"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.repeats)))
        return
    if not (Path(args.model) / "config.json").exists() and Path(args.model) == DEMO_MODEL:
        from prime_async.models.smollm2 import ensure_smollm2

        ensure_smollm2(DEMO_MODEL)
    results = {}
    for kind in ("fsdp", "megatron"):
        cmd = [sys.executable, __file__, "--child", kind, "--model", args.model]
        cmd += ["--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"model {args.model}, {args.repeats} repeats (median), one CPU process each")
    print(f"{'backend':<10} {'first save s':>12} {'save s':>8} {'load s':>8} {'size MB':>8}")
    for kind, r in results.items():
        print(f"{kind:<10} {r['first_save']:>12.2f} {r['save']:>8.2f} {r['load']:>8.2f} {r['size_mb']:>8.1f}")
    f, m = results["fsdp"], results["megatron"]
    print(f"megatron / fsdp: save {m['save'] / f['save']:.2f}x, load {m['load'] / f['load']:.2f}x")


if __name__ == "__main__":
    main()
