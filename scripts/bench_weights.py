"""Publish + load time of one weights version: filesystem vs distributed vs shared vs raw safetensors.

Usage: uv run python scripts/bench_weights.py [--model models/smollm2-135m-instruct] [--bucket-mb 256]
           [--repeats 3] [--out-dir outputs/bench_weights] [--device cpu|cuda]
(the demo model is built offline by `uv run python scripts/prepare_smollm2.py`)

One embedded engine process serves the model; this process plays trainer rank 0 with the model's full HF
state dict in memory (as `hf_state_dict()` returns it after the FSDP gather, which is not timed). Per
repeat and per path, with the same tensors (perturbed per version so every load changes the weights):

    raw safetensors   save_file + fsync, then load_file of the same file (no engine involved)
    filesystem        publish = BroadcastWriter.publish (broadcasts/step_N, config, tokenizer, fsync, STABLE)
                      load    = /update_weights_from_disk + a 1-token /generate (the engine serves N)
    distributed       publish = the trainer's snapshot (copy to CPU) + bucket plan
                                (DistributedPublisher.publish)
                      load    = every bucket broadcast (gloo) while /update_weights_from_distributed
                                receives it + a 1-token /generate (derived weights rebuilt on first use)
    shared            publish = SharedStore.put (copy into one flat buffer: /dev/shm on CPU, the GPU on cuda)
                      load    = Lend's descriptions + /update_weights_from_tensor (the engine maps the buffer
                                and copies) + a 1-token /generate

`--device cuda`: engine and "trainer" (this process) on one GPU, as `rl` places them on a one-GPU
machine; distributed is skipped there (NCCL refuses two ranks on one GPU, the reason for `shared`).

Joining the weight process group happens once per run (printed separately). Targets (issue): distributed
<= 1x raw safetensors write+read, filesystem <= 2x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from prime_async.launcher.identity import free_ports
from prime_async.weights.process_group import join_weight_group, metas_of, plan_buckets, send_bucket
from prime_async.weights.shared_memory import SharedStore
from prime_async.weights.shared_wire import SHARED_LOAD_FORMAT, encode_share
from prime_async.weights.writer import BroadcastWriter


def start_engine(model: Path, work: Path, device: str = "cpu") -> tuple[subprocess.Popen, str]:
    port = free_ports("127.0.0.1", 1)
    cfg = work / "inference.toml"
    cfg.write_text(
        f'backend = "torch"\nseq_len = 128\noutput_dir = "{work}"\n[model]\npath = "{model}"\n'
        f'[server]\nport = {port}\n[engine]\nmax_running_requests = 1\nnum_threads = 1\ndevice = "{device}"\n'
    )
    log = (work / "engine.log").open("w")
    cmd = [sys.executable, "-m", "prime_async.entrypoints.inference", "@", str(cfg)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited with {proc.returncode}; see {work / 'engine.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("engine not healthy after 600 s")


def post(url: str, route: str, payload: dict) -> dict:
    resp = httpx.post(f"{url}{route}", json=payload, timeout=600)
    body = resp.json()
    if resp.status_code != 200 or body.get("success") is False:
        raise SystemExit(f"{route}: HTTP {resp.status_code} {body}")
    return body


def serve_one_token(url: str, version: int) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    answer = post(url, "/generate", body)
    if answer["meta_info"]["weight_version"] != str(version):
        raise SystemExit(f"engine serves {answer['meta_info']['weight_version']}, expected {version}")


def raw_roundtrip(state: dict[str, torch.Tensor], path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    save_file(state, str(path), metadata={"format": "pt"})
    with path.open("rb") as fh:
        os.fsync(fh.fileno())
    t1 = time.perf_counter()
    loaded = load_file(str(path))
    assert len(loaded) == len(state)
    return t1 - t0, time.perf_counter() - t1


def filesystem_version(url: str, publisher: BroadcastWriter, state, version: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    path = publisher.publish(state, version)
    t1 = time.perf_counter()
    post(url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
    serve_one_token(url, version)
    return t1 - t0, time.perf_counter() - t1


class Group:
    """This process as rank 0 of a weight process group with the engine."""

    def __init__(self, url: str):
        self.url, self.name = url, "bench-weights"
        port, out = free_ports("127.0.0.1", 1), {}
        t0 = time.perf_counter()
        join = threading.Thread(
            target=lambda: out.setdefault(
                "pg",
                join_weight_group(
                    backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                    group_name=self.name,
                ),
            )
        )  # fmt: skip
        join.start()
        post(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": self.name, "backend": "gloo",
        })  # fmt: skip
        join.join()
        self.pg, self.join_s = out["pg"], time.perf_counter() - t0

    def version(self, state, version: int, bucket_bytes: int, tied: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        if tied:
            tensors.pop("lm_head.weight", None)
        buckets = plan_buckets(metas_of(tensors), bucket_bytes)
        t1 = time.perf_counter()
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            sender = threading.Thread(
                target=send_bucket, args=(self.pg, tensors, bucket, torch.device("cpu"))
            )
            sender.start()
            payload = {
                "names": [m.name for m in bucket], "dtypes": [m.dtype for m in bucket],
                "shapes": [m.shape for m in bucket], "group_name": self.name, "flush_cache": last,
            }  # fmt: skip
            if last:
                payload["weight_version"] = str(version)
            post(self.url, "/update_weights_from_distributed", payload)
            sender.join()
        serve_one_token(self.url, version)
        return t1 - t0, time.perf_counter() - t1


def shared_version(url: str, store: SharedStore, state, version: int, tied: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    store.put({k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}, version)
    t1 = time.perf_counter()
    [share] = store.lend(version, 1)
    post(url, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_share(share)], "load_format": SHARED_LOAD_FORMAT,
        "weight_version": str(version),
    })  # fmt: skip
    store.give_back(version)
    serve_one_token(url, version)
    return t1 - t0, time.perf_counter() - t1


def perturbed(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    return {k: v + 1e-3 * version for k, v in base.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/bench_weights"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model (build it: uv run python scripts/prepare_smollm2.py)")
    torch.set_num_threads(1)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    base = load_file(str(args.model / "model.safetensors"))
    size_mb = sum(t.numel() * t.element_size() for t in base.values()) / 2**20
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_weights_", dir=args.out_dir))
    proc, url = start_engine(args.model, work, args.device)
    store = SharedStore(torch.device(args.device), keep=2)
    try:
        publisher = BroadcastWriter(output_dir=work, model_config=config, source_dir=args.model, keep_last=2)
        group = Group(url) if args.device == "cpu" else None
        paths = ["raw safetensors", "filesystem", "shared"] + (["distributed"] if group else [])
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for r in range(args.repeats):
            v = 3 * r + 1
            state = perturbed(base, v)
            rows["raw safetensors"].append(raw_roundtrip(state, work / "raw.safetensors"))
            rows["filesystem"].append(filesystem_version(url, publisher, state, v))
            rows["shared"].append(shared_version(url, store, perturbed(base, v + 1), v + 1, tied))
            if group is not None:
                state = perturbed(base, v + 2)
                rows["distributed"].append(group.version(state, v + 2, int(args.bucket_mb * 2**20), tied))
        report(rows, size_mb, group.join_s if group else None, args)
    finally:
        store.close()
        proc.terminate()
        proc.wait(timeout=60)


def report(rows: dict[str, list[tuple[float, float]]], size_mb: float, join_s: float | None, args) -> None:
    join = f"group join (once): {join_s:.2f} s" if join_s is not None else "distributed skipped on one GPU"
    print(f"\n{args.model} ({size_mb:.0f} MiB of tensors) on {args.device}, bucket {args.bucket_mb:g} MiB, "
          f"median of {args.repeats}; {join}")  # fmt: skip
    raw_total = statistics.median(a + b for a, b in rows["raw safetensors"])
    print(f"{'path':<18}{'publish/write s':>16}{'load/read s':>13}{'total s':>9}{'x raw':>7}")
    for name, values in rows.items():
        pub = statistics.median(a for a, _ in values)
        load = statistics.median(b for _, b in values)
        total = statistics.median(a + b for a, b in values)
        print(f"{name:<18}{pub:>16.3f}{load:>13.3f}{total:>9.3f}{total / raw_total:>7.2f}")


if __name__ == "__main__":
    main()
