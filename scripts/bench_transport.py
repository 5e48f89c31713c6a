"""Throughput of the ZeroMQ batch stream for a ~50 MB batch, next to a raw memcpy of the same bytes.

    uv run python scripts/bench_transport.py [--mbytes 50] [--iters 10] [--micro-batches 64]

The `zmq + CURVE` line is the same stream with `transport.curve = "on"` (what a non-loopback bind uses:
every frame encrypted and authenticated).

One step = `BatchSender.send` (encode header + cache, frames sent with copy=False over tcp loopback) until
`BatchReceiver.receive` returns the decoded, validated micro-batches in another thread. The memcpy line
copies the same arrays with `np.copyto` (the lower bound of any transport that moves the bytes once).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from prime_async.testing.synthetic import make_batch, transport_cfg
from prime_async.transport.curve import generate_keys
from prime_async.transport.types import ARRAY_DTYPES
from prime_async.transport.zmq_batches import BatchReceiver, BatchSender

BYTES_PER_TOKEN = sum(dt.itemsize for dt in ARRAY_DTYPES.values())


def build(mbytes: float, micro_batches: int):
    tokens_per_mb = int(mbytes * 1e6 / BYTES_PER_TOKEN / micro_batches)
    samples = [256] * (tokens_per_mb // 256)
    return make_batch(0, [[samples] * micro_batches], vocab=32000)


def nbytes(batch) -> int:
    return sum(getattr(mb, n).nbytes for mb in batch.micro_batches[0] for n in ARRAY_DTYPES)


def bench_zmq(batch, iters: int, curve: bool = False) -> list[float]:
    if curve:
        keys = generate_keys(Path(tempfile.mkdtemp(prefix="bench-curve-")) / "keys")
        cfg = transport_cfg(timeout_s=60, curve="on", curve_keys_dir=keys)
    else:
        cfg = transport_cfg(timeout_s=60)
    done = [threading.Event() for _ in range(iters + 1)]
    rx = BatchReceiver(cfg=cfg, rank=0, world_size=1)

    def receive_all() -> None:
        for s in range(iters + 1):
            got = rx.receive(s)
            assert len(got.micro_batches) == len(batch.micro_batches[0])
            done[s].set()

    times = []
    with BatchSender(cfg=cfg, num_ranks=1, resend_window=2) as sender:
        t = threading.Thread(target=receive_all, daemon=True)
        t.start()
        for s in range(iters + 1):  # step 0 is warm-up (connection, handshake)
            batch.step = s
            t0 = time.perf_counter()
            sender.send(batch)
            done[s].wait(60)
            if s:
                times.append(time.perf_counter() - t0)
        t.join(10)
    rx.close()
    return times


def bench_memcpy(batch, iters: int) -> list[float]:
    arrays = [getattr(mb, n) for mb in batch.micro_batches[0] for n in ARRAY_DTYPES]
    outs = [np.empty_like(a) for a in arrays]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for a, o in zip(arrays, outs, strict=True):
            np.copyto(o, a)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=float, default=50.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=64)
    args = ap.parse_args()
    batch = build(args.mbytes, args.micro_batches)
    size = nbytes(batch)
    print(
        f"batch: {size / 1e6:.1f} MB, {args.micro_batches} micro-batches, "
        f"{6 * args.micro_batches} array frames"
    )
    for name, times in (
        ("zmq (send->received)", bench_zmq(batch, args.iters)),
        ("zmq + CURVE", bench_zmq(batch, args.iters, curve=True)),
        ("memcpy (np.copyto)", bench_memcpy(batch, args.iters)),
    ):
        med = statistics.median(times)
        print(
            f"{name:22s} median {med * 1e3:8.2f} ms  {size / med / 2**30:6.2f} GiB/s  "
            f"(best {size / min(times) / 2**30:.2f} GiB/s, {len(times)} iters)"
        )


if __name__ == "__main__":
    main()
