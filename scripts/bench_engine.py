"""Decode throughput of the embedded engine vs `model.generate`, side by side, at batch 1, 8 and 64.

Usage:
    uv run python scripts/bench_engine.py                      # tiny random model (built offline)
    uv run python scripts/bench_engine.py --model-dir models/smollm2-135m-instruct --new-tokens 64

Both sides sample (temperature 1) `--new-tokens` tokens per request from `--prompt-len`-token prompts,
ignoring EOS, with `--threads` torch threads; tokens/s counts generated tokens over wall time including
prefill. The engine is driven in-process (no HTTP) with all requests submitted at once.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

from prime_async.inference.engine import Engine
from prime_async.inference.sampler import SamplingParams


def bench_generate(model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                  top_k=0, top_p=1.0, pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        model.generate(ids[:, :4], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt_len + new_tokens
    return batch * new_tokens / elapsed


async def _engine_round(engine: Engine, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    await engine.generate(prompts[0][:4], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return batch * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="HF dir (default: build the tiny model)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from prime_async.models.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory()  # removed at exit
        model_dir = build_tiny_model(Path(tmp.name) / "tiny")
    engine = Engine(
        model_path=str(model_dir), device=args.device, max_running_requests=max(args.batches),
        max_len=args.prompt_len + args.new_tokens + 8, num_threads=args.threads,
    )  # fmt: skip
    engine.start()
    model = engine.runner.model
    vocab = engine.vocab_size
    print(f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, threads {args.threads}")  # fmt: skip
    print(f"{'batch':>5} {'engine tok/s':>13} {'generate tok/s':>15} {'speedup':>8}")
    try:
        for b in args.batches:
            eng = asyncio.run(_engine_round(engine, b, args.prompt_len, args.new_tokens, vocab))
            ref = bench_generate(model, b, args.prompt_len, args.new_tokens, vocab)
            print(f"{b:>5} {eng:>13.0f} {ref:>15.0f} {eng / ref:>7.2f}x", flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
