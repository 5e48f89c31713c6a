"""Decode throughput of the embedded engine vs `model.generate`, side by side, at batch 1, 8 and 64.

Usage:
    uv run python scripts/bench_engine.py                      # tiny random model (built offline)
    uv run python scripts/bench_engine.py --model-dir models/smollm2-135m-instruct --new-tokens 32

The sides run alternately (`--repeats` rounds, order rotated each round) and the medians are printed:
HF `generate`, the engine with `kernels = "dense"` (plain F.linear: the engine before oneDNN packing)
and with `kernels = "packed"` (the default), each with every `--decode-steps` (`inference.engine.decode_step`:
eager = shapes follow the batch, static = padded to batch buckets, graphs = the static step replayed as
CUDA graphs, auto = graphs on CUDA and static on CPU; with more than one, an engine is named
`KERNELS-STEP` with the step resolved, e.g. `--decode-steps eager auto`: `dense-eager dense-graphs` on CUDA,
`dense-eager dense-static` on CPU). All
sample (temperature 1) `--new-tokens` tokens per request from `--prompt-len`-token prompts, ignoring EOS,
with `--threads` torch threads; tokens/s counts generated tokens over wall time including prefill.
Engines are driven in-process (no HTTP) with all requests of a round submitted at once.

Accuracy, from the same rounds: `max|dlogp|` is, per engine, the largest |logprob the engine reported -
log_softmax of an HF fp32 forward of prompt + output| over every generated token of its last round.

Roofline: the machine's memory bandwidth (a large tensor sum) and fp32 matmul peak (a 1024^3 matmul)
are measured here, then one decode step of each engine is timed alone at `prompt + new/2` positions:
`mem` = weight bytes read per step / step time / bandwidth (the limit at small batches), `compute` =
matmul FLOPs per step / step time / peak (the limit at large batches), `matmul` = share of the step
spent in matmul kernels (torch profiler; the rest is what fusing or compiling could still remove).
On a machine shared with other jobs, `--clock cpu` times CPU seconds of this process instead of wall time.
With `--device cuda` every tensor fed to the model is built on the model's device (`model_device`), the
machine's limits are measured on that GPU, and each timed region ends with a CUDA synchronize. An engine
that captures graphs first runs one untimed round of the same shape (its graphs are captured lazily, once
per batch bucket and KV span); with graphs the `matmul` share is not measured (the kernels run inside the
replay) and reads 0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prime_async.inference.engine import Engine, RequestOutput
from prime_async.inference.engine_settings import EngineSettings, SlotSettings
from prime_async.inference.sampler import SamplingParams
from prime_async.inference.static_decode import resolve_decode_step
from prime_async.utils.devices import model_device, on_model

KERNELS = ("dense", "packed")
DECODE_STEPS = ("auto", "eager", "static", "graphs")
# --clock cpu: CPU seconds of this process, for a machine shared with other jobs (waiting for a core is not
# counted; sharing caches and memory bandwidth still is)
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = _CLOCKS["wall"]
CPU = torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs asynchronously: a timer must not stop before)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_generate(model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    ids = on_model(model, torch.randint(3, vocab, (batch, prompt_len), generator=gen))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                  top_k=0, top_p=1.0, pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        model.generate(ids[:, :4], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _sync(ids.device)
        start = _clock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        _sync(ids.device)
        elapsed = _clock() - start
    assert out.shape[1] == prompt_len + new_tokens
    return batch * new_tokens / elapsed


Round = tuple[list[list[int]], list[RequestOutput]]  # prompts and what the engine returned for them


async def _engine_round(
    engine: Engine, batch: int, prompt_len: int, new_tokens: int, vocab: int
) -> tuple[float, Round]:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    await engine.generate(prompts[0][:4], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    if _captures(engine):  # capture every (bucket, span) this round replays, untimed
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    start = _clock()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    elapsed = _clock() - start
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return batch * new_tokens / elapsed, (prompts, outs)


def _captures(engine: Engine) -> bool:
    static = engine.runner.static
    return static is not None and static.capture is not None


def max_logprob_error(model, round_: Round) -> float:
    """Largest |engine logprob - log_softmax of an HF forward of `model`| over the round's generated tokens
    (temperature 1). The sequences are built on the model's device (a CUDA model gets CUDA ids)."""
    prompts, outs = round_
    seqs = on_model(model, [p + o.output_ids for p, o in zip(prompts, outs, strict=True)], dtype=torch.long)
    reported = torch.tensor([o.logprobs for o in outs], dtype=torch.float64)
    start = len(prompts[0])
    with torch.inference_mode():
        logp = model(seqs).logits.float().log_softmax(-1)[:, start - 1 : -1]
        ref = logp.gather(-1, seqs[:, start:, None])[..., 0].double().cpu()
    return float((reported - ref).abs().max())


def _median_time(fn, repeats: int = 5, device: torch.device = CPU) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = _clock()
        fn()
        _sync(device)
        times.append(_clock() - start)
    return statistics.median(times)


def machine_limits(device: torch.device = CPU) -> tuple[float, float]:
    """(read bandwidth in bytes/s, fp32 matmul FLOP/s) of `device` (on CPU: this thread count)."""
    big = torch.ones(64 * 2**20, device=device)  # 256 MiB, far beyond the per-core caches
    bandwidth = big.numel() * big.element_size() / _median_time(big.sum, device=device)
    n = 1024 if device.type == "cpu" else 8192  # a GPU needs a large matmul to reach its peak
    a = torch.randn(n, n, device=device)
    peak = 2 * n**3 / _median_time(lambda: a @ a, device=device)
    return bandwidth, peak


def step_costs(engine: Engine) -> tuple[int, int]:
    """(weight bytes read, matmul FLOPs per row) of one decode step: every projection plus the LM head."""
    runner = engine.runner
    projections = [p for lw in runner.layers for k, p in lw.items() if k in ("qkv", "o", "gate_up", "down")]
    projections.append(runner.lm_head)
    nbytes = sum(p.weight.numel() * p.weight.element_size() for p in projections)
    return nbytes, 2 * sum(p.weight.numel() for p in projections)


def _fill_slots(engine: Engine, batch: int, length: int) -> tuple[list[int], list[int]]:
    prompts = [[3 + (slot + i) % 97 for i in range(length)] for slot in range(batch)]
    engine.runner.prefill(prompts, list(range(batch)))
    return [5] * batch, [length] * batch


def decode_step_time(engine: Engine, batch: int, length: int) -> tuple[float, float]:
    """(median seconds of one decode step over `batch` slots at `length` positions, matmul share), by the
    engine's own decode path (`ModelRunner.decode_rows`: eager, static or graphs)."""
    ids, pos = _fill_slots(engine, batch, length)
    step = lambda: engine.runner.decode_rows(ids, pos)  # noqa: E731
    step()
    seconds = _median_time(step, device=model_device(engine.runner.model))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in _MATMUL_KERNELS)
    return seconds, matmul / max(total, 1)


_MATMUL_KERNELS = {"aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"}


def throughput_rounds(
    engines: dict[str, Engine], model, batch: int, args
) -> tuple[dict[str, float], dict[str, Round]]:
    """Median tokens/s of HF generate and each engine over `args.repeats` alternating rounds, and each
    engine's last round."""
    sides = ["generate", *engines]
    samples: dict[str, list[float]] = {s: [] for s in sides}
    last: dict[str, Round] = {}
    shape = (batch, args.prompt_len, args.new_tokens, model.config.vocab_size)
    for r in range(args.repeats):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:  # rotate who goes first
            if side == "generate":
                tok_s = bench_generate(model, *shape)
            else:
                tok_s, last[side] = asyncio.run(_engine_round(engines[side], *shape))
            samples[side].append(tok_s)
    return {s: statistics.median(v) for s, v in samples.items()}, last


def roofline_line(engine: Engine, batch: int, length: int, limits: tuple[float, float]) -> str:
    bandwidth, peak = limits
    nbytes, flops_per_row = step_costs(engine)
    seconds, matmul_share = decode_step_time(engine, batch, length)
    mem = nbytes / seconds / bandwidth
    compute = batch * flops_per_row / seconds / peak
    return f"{seconds * 1e3:6.1f} ms  mem {mem:4.0%}  compute {compute:4.0%}  matmul {matmul_share:4.0%}"


def build_engines(model_dir: Path, args) -> dict[str, Engine]:
    """One engine per kernels x decode step, named by the kernels alone when one decode step is asked, else
    KERNELS-STEP with the step resolved on this device (`auto` reads `graphs` on CUDA, `static` on CPU)."""
    engines = {}
    device = torch.device(
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    for kernels in args.kernels:
        for step in args.decode_steps:
            resolved = resolve_decode_step(step, device)
            name = kernels if len(args.decode_steps) == 1 else f"{kernels}-{resolved}"
            slots = SlotSettings(
                max_running_requests=max(args.batches), max_len=args.prompt_len + args.new_tokens + 8,
                decode_step=step,
            )  # fmt: skip
            engines[name] = Engine(EngineSettings(
                model_path=str(model_dir), device=args.device, num_threads=args.threads, kernels=kernels,
                dtype=args.dtype, slots=slots,
            ))  # fmt: skip
            engines[name].start()
    return engines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="HF dir (default: build the tiny model)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per batch size (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall", help="wall or CPU seconds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), help="engines to run")
    parser.add_argument(
        "--decode-steps", nargs="+", choices=DECODE_STEPS, default=["auto"],
        help="decode paths to run side by side (inference.engine.decode_step), e.g. eager graphs",
    )  # fmt: skip
    parser.add_argument("--dtype", default="auto", help="engine dtype: auto, float32 or bfloat16")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    global _clock
    _clock = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from prime_async.models.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory()  # removed at exit
        model_dir = build_tiny_model(Path(tmp.name) / "tiny")
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    limits = machine_limits(
        torch.device(name)
    )  # before the engine threads exist (measured ~2x lower after, here)
    engines = build_engines(model_dir, args)
    model = next(iter(engines.values())).runner.model
    print(f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, threads {args.threads}, "
          f"repeats {args.repeats}, clock {args.clock}, dtype {args.dtype}; machine: "
          f"read {limits[0] / 1e9:.1f} GB/s, fp32 matmul {limits[1] / 1e9:.0f} GFLOP/s")  # fmt: skip
    names = list(engines)
    print(f"{'batch':>5} {'generate':>9} " + " ".join(f"{k:>9}" for k in names) + " "
          + " ".join(f"{k + '/gen':>11}" for k in names) + "   (tokens/s, medians)   "
          + " ".join(f"{'max|dlogp| ' + k:>20}" for k in names))  # fmt: skip
    length = args.prompt_len + args.new_tokens // 2
    try:
        for b in args.batches:
            m, last = throughput_rounds(engines, model, b, args)
            errors = [max_logprob_error(model, last[k]) for k in names]
            print(f"{b:>5} {m['generate']:>9.1f} " + " ".join(f"{m[k]:>9.1f}" for k in names) + " "
                  + " ".join(f"{m[k] / m['generate']:>10.2f}x" for k in names) + "                         "
                  + " ".join(f"{e:>20.2e}" for e in errors), flush=True)  # fmt: skip
            for kernels, engine in engines.items():
                line = roofline_line(engine, b, length, limits)
                print(f"      decode step {kernels:>6}: {line}", flush=True)
    finally:
        for engine in engines.values():
            engine.stop()


if __name__ == "__main__":
    main()
