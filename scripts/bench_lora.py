"""Full-weight vs LoRA training on the demo model, side by side in one run: weight-sync time and bytes per
update, trainer step time, trainer peak memory.

Usage:
    uv run python scripts/prepare_smollm2.py models/smollm2-135m-instruct   # once, offline
    uv run python scripts/bench_lora.py                                     # SmolLM2 demo model
    uv run python scripts/bench_lora.py --model models/tiny --rank 8        # quick, tiny model

Each side runs in its own child process (so peak memory is its own), built by the trainer's code
(`trainer/fsdp.py::FsdpBackend`, with `lora` None or set):

1. trainer: `--steps` train steps on one synthetic batch shaped like the demo's (`--samples` samples of
   `--prompt-len` + `--completion-len` tokens, packed into rows of `--seq-len`); the median step time
   is reported, and the process's peak RSS after training (`trainer peak RSS`, on CUDA also
   `torch.cuda.max_memory_allocated`) and the bytes of the AdamW state;
2. publish: `--updates` times the version the trainer writes after a step (`Trainer.publish`: full state
   dict -> `model.safetensors` + config + tokenizer, or the adapter -> `adapter_model.safetensors` +
   `adapter_config.json`), timed, with the bytes of the broadcast directory;
3. load: the embedded engine (`inference/engine.py`, in process, no HTTP) loads each version the way
   the orchestrator makes it (`/update_weights_from_disk` resp. `/load_lora_adapter` + unload of the
   previous adapter), timed. `sync` = publish + load: what one in-flight update costs end to end,
   besides the pause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _batch(args: argparse.Namespace, step: int):
    import numpy as np

    from prime_async.testing.synthetic import make_micro_batch
    from prime_async.transport.zmq_batches import RankBatch

    rng = np.random.default_rng(step)
    per_row = max(1, args.seq_len // (args.prompt_len + args.completion_len))
    rows, left = [], args.samples
    while left > 0:
        n = min(per_row, left)
        rows.append(make_micro_batch(rng, [args.prompt_len + args.completion_len] * n, vocab=args.vocab))
        left -= n
    return RankBatch(
        step=step, rank=0, micro_batches=rows, layout=[[len(r.input_ids)] for r in rows],
        num_loss_tokens=sum(r.num_loss_tokens for r in rows), temperature=1.0, min_dispatch_version=step,
    )  # fmt: skip


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def side(args: argparse.Namespace) -> dict:
    """One side in this process; returns its figures."""
    import torch

    from prime_async.config.trainer import TrainerConfig
    from prime_async.inference.engine import Engine
    from prime_async.trainer.fsdp import FsdpBackend
    from prime_async.weights.writer import BroadcastWriter

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank} if args.side == "lora" else None
    out = Path(tempfile.mkdtemp(prefix=f"bench_lora_{args.side}_"))
    cfg = TrainerConfig.model_validate(
        {"model": {"path": args.model}, "output_dir": str(out), "seq_len": args.seq_len, "lora": lora,
         "loss": {"type": "mask", "ratio_low": 1e-6, "ratio_high": 1e6}, "optim": {"lr": 1e-5}}
    )  # fmt: skip
    backend = FsdpBackend(cfg, device, 1)
    trainable = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    times = []
    for step in range(args.steps):
        batch = _batch(args, step)
        t0 = time.perf_counter()
        backend.train_rank_batch(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    figures = {
        "trainable_params": trainable,
        "step_s": statistics.median(times[1:] if len(times) > 1 else times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "optim_state_bytes": sum(
            t.numel() * t.element_size()
            for st in backend.optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t)
        ),
    }
    if device.type == "cuda":
        figures["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    pub = BroadcastWriter(output_dir=out, model_config=backend.pretrained_config(), source_dir=args.model,
                          keep_last=args.updates + 1)  # fmt: skip
    publish_s, paths = [], []
    for v in range(1, args.updates + 1):
        t0 = time.perf_counter()
        if lora is None:
            paths.append(pub.publish(backend.hf_state_dict(), v))
        else:
            paths.append(pub.publish_adapter(*backend.lora_adapter(), v))
        publish_s.append(time.perf_counter() - t0)
    figures["bytes_per_update"] = _dir_bytes(paths[-1])
    figures["publish_s"] = statistics.median(publish_s)
    del backend
    figures["load_s"] = asyncio.run(_engine_loads(args, paths, lora is not None, Engine))
    figures["sync_s"] = figures["publish_s"] + figures["load_s"]
    return figures


async def _engine_loads(args: argparse.Namespace, paths: list[Path], lora: bool, engine_cls) -> float:
    engine = engine_cls(model_path=args.model, max_len=args.seq_len, num_threads=args.threads,
                        max_lora_rank=args.rank if lora else None, max_loaded_loras=2)  # fmt: skip
    engine.start()
    try:
        times = []
        for v, path in enumerate(paths, start=1):
            t0 = time.perf_counter()
            if lora:
                await engine.load_lora_adapter(f"v{v}", str(path))
                if v > 1:
                    await engine.unload_lora_adapter(f"v{v - 1}")
            else:
                await engine.update_weights(str(path), str(v), flush_cache=True, abort_all=False)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        engine.stop()


def _child(args: argparse.Namespace, which: str) -> dict:
    cmd = [sys.executable, __file__, "--child", which, *sys.argv[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{which} side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict]) -> str:
    rows = [
        ("trainable parameters", "trainable_params", "{:,.0f}"),
        ("bytes per update (MiB)", "bytes_per_update", None),
        ("publish per update (s)", "publish_s", "{:.3f}"),
        ("engine load per update (s)", "load_s", "{:.3f}"),
        ("weight sync per update (s)", "sync_s", "{:.3f}"),
        ("optimizer state (MiB)", "optim_state_bytes", None),
        ("trainer step, median (s)", "step_s", "{:.3f}"),
        ("trainer peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
        ("trainer CUDA peak (MiB)", "cuda_peak_mib", "{:.0f}"),
    ]
    full, lora = results["full"], results["lora"]
    lines = [f"{'':30s} {'full':>14s} {'lora':>14s} {'lora/full':>10s}"]
    for label, key, fmt in rows:
        if key not in full:
            continue
        a, b = full[key], lora[key]
        if fmt is None:
            sa, sb = f"{a / 2**20:.2f}", f"{b / 2**20:.3f}"
        else:
            sa, sb = fmt.format(a), fmt.format(b)
        lines.append(f"{label:30s} {sa:>14s} {sb:>14s} {b / a if a else float('nan'):>10.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models/smollm2-135m-instruct"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1000, help="token ids of the synthetic batch are < this")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"{args.model} has no config.json: run scripts/prepare_smollm2.py first")
    if args.child is not None:
        args.side = args.child
        print(json.dumps(side(args)))
        return
    results = {which: _child(args, which) for which in ("full", "lora")}
    print(f"model {args.model}, LoRA rank {args.rank} on q/k/v/o/gate/up/down, batch {args.samples} x "
          f"({args.prompt_len} + {args.completion_len}) tokens, {args.threads} thread(s)")  # fmt: skip
    print(_table(results))


if __name__ == "__main__":
    main()
