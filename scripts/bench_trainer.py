"""Trainer step throughput on the demo model, before/after side by side, with a phase breakdown.

Usage:
    uv run python scripts/bench_trainer.py                                  # SmolLM2, echo_text's shape
    uv run python scripts/bench_trainer.py --prompt-len 100 --completion-len 32 --group-size 4 --compile

One batch shaped like the demo's (`--episodes` episodes in groups of `--group-size` that share a
`--prompt-len`-token prompt, each with up to `--completion-len` sampled tokens; sampler logprobs = the
model's own plus noise) is built by the orchestrator's own `build_train_batch` and trained by each side
in turn, `--repeats` steps each, alternating; medians are printed:

- `before`: the step as the trainer ran it two changes ago: logits of every position, `log_softmax` over
  the whole vocab then gather, single-tensor AdamW (torch's CPU default); every episode packed whole;
- `after`: the trainer's code (`trainer/fsdp.py`, `trainer/packed_rows.py`, `trainer/optim.py`): LM head
  only on the positions that predict loss tokens, logsumexp-based gather, fused AdamW; every episode
  packed whole (`packing.share_prompt_prefix = false`);
- `shared`: the same code on the batch packed with `packing.share_prompt_prefix = true` (the default): each
  group's prompt runs once, its episodes are branches after it;
- `shared+compile` (with `--compile`): the same with `compile = true` (each decoder layer compiled);
  its first step (compilation) is reported separately.

`tokens/s` counts episode tokens (prompt + completion of every episode, a shared prompt once per
episode), so the sides are comparable: the work done, not the tokens the model ran.

Phases: `pack` (row arrays -> tensors), `forward` (model up to the logits), `logprobs` (logits ->
logprob, entropy), `loss` (loss fn + statistics), `backward`, `optim` (clip + AdamW + schedule).
`train_step` times one call of the real `fsdp.train_step` per side (no phase timers) as a check.
The script also prints the largest logprob difference between the two gathers on the loss tokens.
On a machine shared with other jobs, `--clock cpu` times CPU seconds of this process instead of wall time.

Throughput and MFU (`--device cuda` or `--device cpu`): a random Qwen3-shaped model is built offline
(`--shape qwen3-0.6b`: Qwen3-0.6B's shape, 28 layers, hidden 1024, 16/8 heads of 128, vocabulary 151936;
`--shape tiny` for a CPU test), and each backend of `--backends` (fsdp, megatron) is built by the trainer's
own `build_backend` and trains `--steps` timed steps (after one warm-up step) of one synthetic batch:
`--rows` packed rows of `--seq-len` tokens, `--samples-per-row` samples each, the first half of every sample
prompt, the rest loss tokens. Printed per backend: median step seconds, tokens/s (tokens the model ran),
and MFU = model FLOPs per step / step time / the bf16 matmul peak measured on the device (a square matmul,
8192 on CUDA, 512 on CPU). Model FLOPs per step (`step_flops`) = 3 x forward (backward = 2 x forward): 2 x
the decoder's matmul weights per token, 4 x layers x heads x head_dim x the causal context per token
(attention scores and values), and the LM head only on positions that predict a loss token (what the fsdp
backend computes; megatron computes it on every position, which this count does not reward). The model
dtype is `--dtype` (auto: bfloat16 on CUDA, float32 on CPU).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.config.trainer import TrainerConfig
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode
from prime_async.trainer.fsdp import RowTensors, load_model, row_loss, train_step
from prime_async.trainer.loss import build_loss_fn
from prime_async.trainer.optim import build_optimizer, build_scheduler
from prime_async.trainer.packed_rows import logit_rows, packed_logprobs, row_logits, scatter_rows
from prime_async.trainer.parallelize import parallelize
from prime_async.transport.types import MicroBatch
from prime_async.transport.zmq_batches import RankBatch

PHASES = ("pack", "forward", "logprobs", "loss", "backward", "optim")
# --clock cpu: CPU seconds of this process, for a machine shared with other jobs (waiting for a core is not
# counted; sharing caches and memory bandwidth still is)
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = _CLOCKS["wall"]


def full_vocab_gather(logits_tv: torch.Tensor, ids: torch.Tensor, temperature: float):
    """The gather as it was (the reference): log_softmax of every position over the vocab, then gather."""
    logprobs_tv = torch.log_softmax(logits_tv[:-1].float() / temperature, dim=-1)
    logp_t = logprobs_tv.gather(-1, ids[1:, None])[:, 0]
    with torch.no_grad():
        entropy_t = -(logprobs_tv.exp() * logprobs_tv).sum(-1)
    zero = torch.zeros(1, dtype=logp_t.dtype)
    return torch.cat([zero, logp_t]), torch.cat([zero, entropy_t])


def _lap(clock: dict[str, float], phase: str, since: float) -> float:
    now = _clock()
    clock[phase] += now - since
    return now


class Side:
    """A model + optimizer trained with one variant of the step, on batches packed with or without
    shared prompts."""

    def __init__(self, name: str, cfg: TrainerConfig, *, new_path: bool, shared: bool):
        self.name, self.cfg, self.new_path, self.shared = name, cfg, new_path, shared
        model = load_model(cfg, torch.device("cpu"))
        self.model = parallelize(model, activation_checkpointing=False, compile=cfg.runtime.compile)
        if new_path:
            self.optimizer = build_optimizer(cfg.optim, self.model)
        else:  # what build_optimizer made before: torch's default, the single-tensor loop on CPU
            o = cfg.optim
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
            )
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, None)
        self.loss_fn = build_loss_fn(cfg.loss)

    def _logprobs(self, row: RowTensors, temperature: float, clock: dict[str, float]):
        tick = _clock()
        if self.new_path:
            rows = logit_rows(row.ids.shape[0], row.mask, row.ids.device)
            logits_nv = row_logits(self.model, row.ids, row.pos, rows)
            tick = _lap(clock, "forward", tick)
            logp, entropy = scatter_rows(logits_nv, rows, row.ids, temperature)
        else:
            logits_tv = self.model(input_ids=row.ids[None], position_ids=row.pos[None], use_cache=False)
            tick = _lap(clock, "forward", tick)
            logp, entropy = full_vocab_gather(logits_tv.logits[0], row.ids, temperature)
        _lap(clock, "logprobs", tick)
        return logp, entropy

    def timed_step(self, batch: RankBatch) -> dict[str, float]:
        """One optimizer step over `batch` with a timer per phase (the phases of `fsdp.train_step`)."""
        clock: dict[str, float] = defaultdict(float)
        for mb in batch.micro_batches:
            tick = _clock()
            row = RowTensors.of(mb, torch.device("cpu"))
            _lap(clock, "pack", tick)
            logp, entropy = self._logprobs(row, batch.temperature, clock)
            tick = _clock()
            n = batch.num_loss_tokens
            loss, _ = row_loss(row, logp, entropy, loss_fn=self.loss_fn, num_loss_tokens=n)
            tick = _lap(clock, "loss", tick)
            loss.backward()
            _lap(clock, "backward", tick)
        tick = _clock()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        _lap(clock, "optim", tick)
        clock["total"] = sum(clock[p] for p in PHASES)
        return clock

    def real_step(self, batch: RankBatch) -> float:
        """Seconds of one call of the trainer's own `fsdp.train_step`."""
        tick = _clock()
        train_step(self.model, self.optimizer, self.scheduler, batch, cfg=self.cfg, loss_fn=self.loss_fn,
                   world_size=1)  # fmt: skip
        return _clock() - tick


def demo_groups(model, args) -> list[Group]:
    """Groups of `--group-size` episodes sharing a random prompt, completions of [max/2, max] tokens;
    sampler logprobs = the model's own logprobs plus small noise."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    groups = []
    for g in range(-(-args.episodes // args.group_size)):
        prompt = rng.integers(0, vocab, args.prompt_len).tolist()
        episodes = []
        for _ in range(min(args.group_size, args.episodes - g * args.group_size)):
            n = int(rng.integers(max(1, args.completion_len // 2), args.completion_len + 1))
            ids = prompt + rng.integers(0, vocab, n).tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, args.prompt_len - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.tensor(ids[args.prompt_len :])[:, None]
            )
            noisy = logp[:, 0].numpy() + 0.05 * rng.standard_normal(n)
            episodes.append(Episode(
                example_id=g, token_ids=ids, loss_mask=[False] * args.prompt_len + [True] * n,
                sampler_logprobs=[0.0] * args.prompt_len + noisy.tolist(),
                token_versions=[-1] * args.prompt_len + [0] * n, reward=float(rng.random()),
            ))  # fmt: skip
        groups.append(Group(group_id=g, example_id=g, dispatch_version=0, episodes=episodes))
    return groups


def demo_batch(groups: list[Group], args, *, shared: bool) -> RankBatch:
    """The orchestrator's packing of `groups` (with or without shared prompts) as rank 0's batch."""
    batch = build_train_batch(
        groups, step=0, seq_len=args.seq_len, num_ranks=1, temperature=1.0,
        advantage_cfg=AdvantageConfig(), share_prefix=shared,
    )  # fmt: skip
    mbs = batch.micro_batches[0]
    return RankBatch(
        step=0, rank=0, micro_batches=mbs, layout=[[mb.num_tokens for mb in mbs]],
        num_loss_tokens=batch.num_loss_tokens, temperature=1.0, min_dispatch_version=0,
        metrics=batch.metrics,
    )  # fmt: skip


def gather_difference(side: Side, batch: RankBatch) -> float:
    """Largest |new - reference| logprob on loss tokens (same weights, both gathers)."""
    worst = 0.0
    with torch.no_grad():
        for mb in batch.micro_batches:
            row = RowTensors.of(mb, torch.device("cpu"))
            new, _ = packed_logprobs(side.model, row.ids, row.pos, batch.temperature, loss_mask=row.mask)
            logits_tv = side.model(input_ids=row.ids[None], position_ids=row.pos[None]).logits[0]
            ref, _ = full_vocab_gather(logits_tv, row.ids, batch.temperature)
            worst = max(worst, float((new - ref)[row.mask].abs().max()))
    return worst


def load_cfg(args, *, compile: bool) -> TrainerConfig:
    import tomllib

    with args.config.open("rb") as f:
        raw = tomllib.load(f)
    raw.update(seq_len=args.seq_len, compile=compile)
    raw.setdefault("model", {})["path"] = str(args.model_dir)
    return TrainerConfig.model_validate(raw)


def build_sides(args) -> list[Side]:
    sides = [Side("before", load_cfg(args, compile=False), new_path=False, shared=False)]
    sides.append(Side("after", load_cfg(args, compile=False), new_path=True, shared=False))
    sides.append(Side("shared", load_cfg(args, compile=False), new_path=True, shared=True))
    if args.compile:
        sides.append(Side("shared+compile", load_cfg(args, compile=True), new_path=True, shared=True))
    return sides


def run_rounds(
    sides: list[Side], batches: dict[bool, RankBatch], repeats: int
) -> dict[str, list[dict[str, float]]]:
    """Alternating timed steps (order rotated each round) after one untimed warm-up step per side
    (optimizer state allocation; compilation, whose time is printed)."""
    for side in sides:
        tick = _clock()
        side.timed_step(batches[side.shared])
        if side.cfg.runtime.compile:
            print(f"{side.name}: first step (compilation) {_clock() - tick:.1f} s", flush=True)
    samples: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
    for r in range(repeats):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            batch = batches[side.shared]
            samples[side.name].append(side.timed_step(batch))
            if side.new_path:
                samples[side.name][-1]["train_step"] = side.real_step(batch)
    return samples


def print_table(samples: dict[str, list[dict[str, float]]], tokens: float) -> None:
    """Median phase times per side and episode tokens per second (`tokens` per step on every side)."""
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in samples.items()}
    columns = " ".join(f"{p:>9}" for p in (*PHASES, "total"))
    print(f"{'side':>14} {columns} {'tokens/s':>9} {'vs before':>9} {'train_step':>10}   (medians)")
    for name, m in med.items():
        times = " ".join(f"{m[p]:>8.2f}s" for p in (*PHASES, "total"))
        real = f"{m['train_step']:>9.2f}s" if "train_step" in m else f"{'-':>10}"
        speedup = med["before"]["total"] / m["total"]
        print(f"{name:>14} {times} {tokens / m['total']:>9.1f} {speedup:>8.2f}x {real}")


SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}  # fmt: skip


def build_random_model(out: Path, shape: str, dtype: torch.dtype) -> Path:
    """A random Qwen3ForCausalLM of `SHAPES[shape]` saved in `dtype` (no tokenizer: trainers need none)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=40960,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6)  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(out)
    return out


def synthetic_batch(vocab: int, *, rows: int, seq_len: int, samples_per_row: int) -> RankBatch:
    """`rows` packed rows of `seq_len` tokens, `samples_per_row` samples each (the last one takes the rest);
    the first half of every sample is prompt, the rest loss tokens sampled at version 0."""
    rng = np.random.default_rng(0)
    mbs = []
    for _ in range(rows):
        lens = [seq_len // samples_per_row] * (samples_per_row - 1)
        lens.append(seq_len - sum(lens))
        pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        mask = np.concatenate([np.arange(n) >= n // 2 for n in lens])
        mbs.append(MicroBatch(
            input_ids=rng.integers(0, vocab, seq_len).astype(np.int32), position_ids=pos, loss_mask=mask,
            advantages=np.where(mask, rng.normal(size=seq_len), 0.0).astype(np.float32),
            sampler_logprobs=np.where(mask, -np.log(vocab) + 0.05 * rng.normal(size=seq_len), 0.0).astype(
                np.float32),
            token_versions=np.where(mask, 0, -1).astype(np.int32),
        ))  # fmt: skip
    return RankBatch(
        step=0, rank=0, micro_batches=mbs, layout=[[mb.num_tokens for mb in mbs]],
        num_loss_tokens=int(sum(mb.num_loss_tokens for mb in mbs)), temperature=1.0, min_dispatch_version=0,
    )  # fmt: skip


def matmul_flops(shape: dict, batch: RankBatch) -> float:
    """FLOPs of the weight matmuls of one training step (3 x forward): every decoder projection on every
    token, the LM head on the positions that predict a loss token."""
    h, layers, heads, kv, hd = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim"))  # fmt: skip
    per_layer = h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * shape["intermediate_size"]
    forward = 0.0
    for mb in batch.micro_batches:
        forward += 2 * layers * per_layer * mb.num_tokens
        forward += 2 * shape["vocab_size"] * h * int(mb.loss_mask[1:].sum())
    return 3 * forward


def attention_flops(shape: dict, batch: RankBatch) -> float:
    """FLOPs of attention scores and values in one training step (3 x forward): each token attends to the
    earlier tokens of its own sample and itself (causal, `position + 1` keys)."""
    heads, hd, layers = shape["num_attention_heads"], shape["head_dim"], shape["num_hidden_layers"]
    keys = sum(float((mb.position_ids.astype(np.float64) + 1).sum()) for mb in batch.micro_batches)
    return 3 * 4 * layers * heads * hd * keys


def step_flops(shape: dict, batch: RankBatch) -> float:
    """Model FLOPs of one training step on `batch` (see the module docstring)."""
    return matmul_flops(shape, batch) + attention_flops(shape, batch)


def bf16_matmul_peak(device: torch.device) -> float:
    """FLOP/s of a square bfloat16 matmul on `device` (median of 5 after a warm-up)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / _timed(lambda: a @ a, device, repeats=5)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` (one warm-up call; the device synchronized around each call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tick = _clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(_clock() - tick)
    return statistics.median(times)


def backend_throughput(name: str, model_dir: Path, device: torch.device, args) -> dict[str, float]:
    """Median step seconds, tokens/s and model FLOPs of backend `name` on the synthetic batch."""
    from prime_async.config.shared import ModelConfig
    from prime_async.trainer.train import build_backend

    cfg = TrainerConfig(backend=name, model=ModelConfig(path=str(model_dir), dtype=args.dtype),
                        seq_len=args.seq_len)  # fmt: skip
    backend = build_backend(cfg, device, world_size=1)
    batch = synthetic_batch(SHAPES[args.shape]["vocab_size"], rows=args.rows, seq_len=args.seq_len,
                            samples_per_row=args.samples_per_row)  # fmt: skip
    seconds = _timed(partial(backend.train_rank_batch, batch), device, repeats=args.steps)
    tokens = sum(mb.num_tokens for mb in batch.micro_batches)
    del backend  # free its memory before the next backend is built
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "flops": step_flops(SHAPES[args.shape], batch),
    }


def throughput_table(args) -> None:
    """Build the random model, then tokens/s and MFU of each backend (fsdp first: megatron's CPU ranks
    install a process-wide mode that must not slow the fsdp backend down)."""
    from prime_async.utils.dtypes import resolve_dtype

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = resolve_dtype(args.dtype, device)
    peak = bf16_matmul_peak(device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(Path(tmp) / args.shape, args.shape, dtype)
        print(f"{args.shape} random model ({dtype}), {args.rows} rows x {args.seq_len} tokens "
              f"({args.samples_per_row} samples each), {device}: bf16 matmul peak {peak / 1e12:.2f} TFLOP/s",
              flush=True)  # fmt: skip
        head = f"{'backend':>9} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7}"
        print(f"{head}   (medians of {args.steps})")
        for name in sorted(args.backends, key=lambda b: b != "fsdp"):
            r = backend_throughput(name, model_dir, device, args)
            achieved = r["flops"] / r["seconds"]
            print(f"{name:>9} {r['seconds']:>8.3f} {r['tokens_per_s']:>10.1f} {achieved / 1e12:>8.3f} "
                  f"{achieved / peak:>7.2%}", flush=True)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--config", type=Path, default=Path("configs/reverse_text/trainer.toml"))
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=6, help="episodes sharing one prompt")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--completion-len", type=int, default=16, help="max; lengths drawn in [max/2, max]")
    parser.add_argument("--seq-len", type=int, default=None, help="default 256; 4096 with --device cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall", help="wall or CPU seconds")
    parser.add_argument("--compile", action="store_true", help="also time compile = true")
    tp = parser.add_argument_group("throughput and MFU (with --device)")
    tp.add_argument("--device", choices=["cpu", "cuda"], default=None, help="run the throughput table")
    tp.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    tp.add_argument("--backends", nargs="+", choices=["fsdp", "megatron"], default=["fsdp", "megatron"])
    tp.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    tp.add_argument("--rows", type=int, default=8, help="packed rows per step")
    tp.add_argument("--samples-per-row", type=int, default=4)
    tp.add_argument("--steps", type=int, default=5, help="timed steps per backend (median)")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (4096 if args.device == "cuda" else 256)
    return args


def main() -> None:
    args = parse_args()
    global _clock
    _clock = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.device is not None:
        throughput_table(args)
        return
    if not args.model_dir.is_dir():
        from prime_async.models.smollm2 import ensure_smollm2

        ensure_smollm2(args.model_dir)
    sides = build_sides(args)
    groups = demo_groups(sides[0].model, args)
    batches = {shared: demo_batch(groups, args, shared=shared) for shared in (False, True)}
    tokens = batches[False].metrics["batch/sample_tokens"]
    print(f"model {args.model_dir}, {args.episodes} episodes in groups of {args.group_size} x "
          f"({args.prompt_len} prompt + <= {args.completion_len} completion) = {tokens:.0f} episode tokens "
          f"({batches[False].num_loss_tokens} loss tokens); unshared {len(batches[False].micro_batches)} "
          f"rows, shared {batches[True].metrics['batch/packed_tokens']:.0f} tokens in "
          f"{len(batches[True].micro_batches)} rows of <= {args.seq_len}; threads {args.threads}, repeats "
          f"{args.repeats}, clock {args.clock}")  # fmt: skip
    print(f"logprob gather: max |new - log_softmax+gather| on loss tokens = "
          f"{gather_difference(sides[1], batches[False]):.2e}", flush=True)  # fmt: skip
    print_table(run_rounds(sides, batches, args.repeats), tokens)


if __name__ == "__main__":
    main()
