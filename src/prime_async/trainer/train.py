"""Trainer main loop: batch n in over ZeroMQ, one optimizer step, weights v_{n+1} out.

    BatchReceiver.receive(n) ──► forward/backward per packed micro-batch (grad accumulation)
         (waits: time/wait_for_batch)      │ loss normalized by the batch's loss tokens
                                           ▼
             clip grads, non-finite check, AdamW step, LR schedule
                                           │
             publish broadcasts/step_{n+1}/ (rank 0) ──► checkpoint every ckpt.interval ──► metrics

Run as `trainer @ trainer.toml` (`entrypoints/trainer.py` calls `run`) or under
`torchrun --nproc-per-node N -m prime_async.entrypoints.trainer` (FSDP2, gloo on CPU / nccl on GPU).

Invariants:
- step n consumes batch n exactly once (the receiver raises on any other step), and publishes v_{n+1};
- every rank runs the same number of forward/backward passes per step (ranks with fewer micro-batches
  run zero-loss padding passes), so FSDP collectives line up;
- the loss of each micro-batch is its token sum divided by the batch's loss tokens (all ranks); FSDP's
  gradient averaging is undone by scaling with the world size, so N ranks give the 1-rank gradient;
- packed samples never attend to each other: position_ids restart at 0 per sample and no attention mask
  is passed, so HF builds a block-diagonal causal mask (tested against per-sample forwards);
- a non-finite loss or grad norm raises before the optimizer step.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from prime_async.config.trainer import OptimConfig, TrainerConfig
from prime_async.trainer.ckpt import (
    checkpoint_steps,
    full_model_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from prime_async.trainer.loss import LossFn, TokenStats, build_loss_fn, reduce_device
from prime_async.trainer.parallelize import parallelize
from prime_async.trainer.step_metrics import build_monitor, run_steps, timing_metrics
from prime_async.trainer.weights import WeightBroadcastHook, WeightPublisher
from prime_async.transport.types import MicroBatch
from prime_async.transport.zmq_batches import BatchReceiver, RankBatch

logger = logging.getLogger(__name__)


# -- setup ----------------------------------------------------------------------------------------------
def setup_distributed() -> tuple[int, int, torch.device]:
    """Init the process group under torchrun; returns (rank, world_size, device)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return rank, world_size, device


def load_model(cfg: TrainerConfig, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.model.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device).train()


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def lr_factor(cfg: OptimConfig, step: int, max_steps: int | None) -> float:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based): warmup, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant" or max_steps is None or max_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps))
    decay = 1 - progress if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


# -- one micro-batch --------------------------------------------------------------------------------------
def packed_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob (T,) of each token under the model at `temperature`, and the entropy (T,) of the
    distribution it was sampled from; position 0 of the row (no predecessor) gets 0 for both."""
    logits_tv = model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False).logits[0]
    logprobs_tv = torch.log_softmax(logits_tv[:-1].float() / temperature, dim=-1)  # predicts tokens 1..T-1
    logp_t = logprobs_tv.gather(-1, input_ids[1:, None].long())[:, 0]
    with torch.no_grad():
        entropy_t = -(logprobs_tv.exp() * logprobs_tv).sum(-1)
    zero = torch.zeros(1, dtype=logp_t.dtype, device=logp_t.device)
    return torch.cat([zero, logp_t]), torch.cat([zero, entropy_t])


def _padding_micro_batch() -> MicroBatch:
    z = np.zeros(2, dtype=np.int32)
    return MicroBatch(
        input_ids=z,
        position_ids=np.arange(2, dtype=np.int32),
        loss_mask=np.zeros(2, dtype=np.bool_),
        advantages=np.zeros(2, dtype=np.float32),
        sampler_logprobs=np.zeros(2, dtype=np.float32),
        token_versions=np.full(2, -1, dtype=np.int32),
    )


def _check_micro_batch(mb: MicroBatch, seq_len: int, step: int) -> None:
    if mb.num_tokens > seq_len:
        raise ValueError(f"batch {step}: micro-batch of {mb.num_tokens} tokens exceeds seq_len={seq_len}")
    if bool((mb.loss_mask & (mb.position_ids == 0)).any()):
        raise ValueError(f"batch {step}: loss token at a sample's first position (it has no context)")


def micro_batch_pass(
    model, mb: MicroBatch, *, loss_fn: LossFn, temperature: float, num_loss_tokens: int, grad_scale: float
) -> tuple[float, TokenStats]:
    """Forward + backward of one packed row; returns its (unscaled) loss share and ratio statistics."""
    device = next(model.parameters()).device
    ids = torch.from_numpy(np.array(mb.input_ids, dtype=np.int64)).to(device)
    pos = torch.from_numpy(np.array(mb.position_ids, dtype=np.int64)).to(device)
    mask = torch.from_numpy(np.array(mb.loss_mask)).to(device)
    sampler_logp = torch.from_numpy(np.array(mb.sampler_logprobs)).to(device)
    advantages = torch.from_numpy(np.array(mb.advantages)).to(device)
    logp, entropy = packed_logprobs(model, ids, pos, temperature)
    out = loss_fn(
        logp=logp,
        sampler_logp=sampler_logp,
        advantages=advantages,
        loss_mask=mask,
        num_loss_tokens=max(num_loss_tokens, 1),
    )
    (out.loss * grad_scale).backward()
    stats = TokenStats.of(logp, torch.where(mask, sampler_logp, logp.detach()), mask, out.masked, entropy)
    return float(out.loss.detach()), stats


def check_staleness(batch: RankBatch, max_off_policy_steps: int | None) -> None:
    """Defence in depth behind the train sink's sweep: no group older than K versions is trained."""
    k = max_off_policy_steps
    if k is not None and batch.step - batch.min_dispatch_version > k:
        raise RuntimeError(
            f"batch {batch.step} holds a group dispatched at version {batch.min_dispatch_version}: "
            f"staleness {batch.step - batch.min_dispatch_version} > max_off_policy_steps={k}"
        )


# -- one step ----------------------------------------------------------------------------------------------
def train_step(
    model, optimizer, scheduler, batch: RankBatch, *, cfg: TrainerConfig, loss_fn, world_size: int
):
    """Gradient accumulation over this rank's micro-batches, clip, non-finite check, optimizer step."""
    if batch.num_loss_tokens < 1:
        raise ValueError(f"batch {batch.step} has no loss tokens")
    grad_scale = float(world_size) if dist.is_initialized() else 1.0  # undo FSDP's gradient averaging
    micro_batches = list(batch.micro_batches)
    for mb in micro_batches:
        _check_micro_batch(mb, cfg.seq_len, batch.step)
    micro_batches += [_padding_micro_batch()] * (batch.max_micro_batches - len(micro_batches))
    loss_sum, stats = 0.0, TokenStats.empty()
    for mb in micro_batches:
        loss, mb_stats = micro_batch_pass(
            model,
            mb,
            loss_fn=loss_fn,
            temperature=batch.temperature,
            num_loss_tokens=batch.num_loss_tokens,
            grad_scale=grad_scale,
        )
        loss_sum += loss
        stats = stats.merge(mb_stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    loss_t = torch.tensor([loss_sum], dtype=torch.float64)
    if dist.is_initialized():
        loss_t = loss_t.to(reduce_device())
        dist.all_reduce(loss_t)
    if not (math.isfinite(grad_norm) and math.isfinite(float(loss_t))):
        raise RuntimeError(f"step {batch.step}: non-finite loss {float(loss_t)} or grad norm {grad_norm}")
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    metrics = {"loss/total": float(loss_t), **stats.all_reduce().metrics()}
    metrics.update({"optim/grad_norm": grad_norm, "optim/lr": lr})
    return metrics


# -- loop --------------------------------------------------------------------------------------------------
class Trainer:
    """Owns model, optimizer, receiver, publisher and monitor; `run()` is the loop."""

    def __init__(self, *, cfg: TrainerConfig, hooks: Sequence[WeightBroadcastHook] = ()):
        self.cfg = cfg
        self.hooks = list(hooks)  # e.g. an NCCL broadcast to engines (interface only so far)
        self.rank, self.world_size, self.device = setup_distributed()
        torch.set_num_threads(cfg.threads or (1 if self.device.type == "cpu" else torch.get_num_threads()))
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg, self.device)
        mesh = None
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.model = parallelize(
            self.model,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
            dp_mesh=mesh,
        )
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg.optim, s, cfg.max_steps)
        )
        self.loss_fn = build_loss_fn(cfg.loss)
        self.step = self._maybe_resume()
        self.publisher = self._build_publisher() if self.rank == 0 else None
        self.monitor = build_monitor(cfg) if self.rank == 0 else None
        self.receiver = BatchReceiver(cfg=cfg.transport, rank=self.rank, world_size=self.world_size)

    def _maybe_resume(self) -> int:
        if not self.cfg.resume:
            return 0
        path = latest_checkpoint(self.cfg.output_dir)
        if path is None:
            raise ValueError(
                f"resume=true but no complete checkpoint under {self.cfg.output_dir}/checkpoints/trainer"
            )
        return load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)

    def _build_publisher(self) -> WeightPublisher:
        source = Path(self.cfg.model.path)
        if not source.is_dir():  # hub id: save its tokenizer once so every version carries it
            from transformers import AutoTokenizer

            source = Path(self.cfg.output_dir) / "tokenizer"
            AutoTokenizer.from_pretrained(self.cfg.model.path).save_pretrained(source)
        return WeightPublisher(
            output_dir=self.cfg.output_dir,
            model_config=self.model.config,
            source_dir=source,
            keep_last=self.cfg.weights.keep_last,
        )

    def publish(self, version: int) -> None:
        state = full_model_state_dict(self.model)  # collective under FSDP
        if self.publisher is not None:
            self.publisher.publish(
                state, version, protected=checkpoint_steps(self.cfg.output_dir, warn=False)
            )
        for hook in self.hooks:
            hook.on_weights(version=version, model=self.model)

    def run_step(self) -> dict[str, float]:
        n = self.step
        t0 = time.perf_counter()
        batch = self.receiver.receive(n)
        t1 = time.perf_counter()
        check_staleness(batch, self.cfg.max_off_policy_steps)
        metrics = train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            cfg=self.cfg,
            loss_fn=self.loss_fn,
            world_size=self.world_size,
        )
        t2 = time.perf_counter()
        self.publish(n + 1)
        t3 = time.perf_counter()
        self.step = n + 1
        if self.cfg.ckpt.interval is not None and self.step % self.cfg.ckpt.interval == 0:
            save_checkpoint(
                output_dir=self.cfg.output_dir,
                step=self.step,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                keep=self.cfg.ckpt.keep,
            )
        metrics.update(timing_metrics(batch, t_start=t0, t_batch=t1, t_trained=t2, t_published=t3))
        return metrics

    @property
    def max_steps(self) -> int | None:
        return self.cfg.max_steps

    def run(self) -> None:
        run_steps(self, logger)


def run(cfg: TrainerConfig) -> None:
    """Train until `cfg.max_steps` (or forever); tears down the process group at the end."""
    if cfg.backend == "megatron":  # same batches, loss and publisher; megatron-core model (trainer/megatron/)
        from prime_async.trainer.megatron.loop import run_megatron

        return run_megatron(cfg)
    try:
        Trainer(cfg=cfg).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
