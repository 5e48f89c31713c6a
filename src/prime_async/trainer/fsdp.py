"""The FSDP2 training backend (`trainer.backend = "fsdp"`): an HF model, AdamW, gradient accumulation.

    RankBatch ──► optim.num_steps_per_batch mini-batches (`mini_batches.py`), each:
                    forward/backward per packed micro-batch (grad accumulation, padding passes),
                    loss normalized by the mini-batch's loss tokens (all ranks),
                    clip grads, non-finite check, AdamW step
              ──► one LR-schedule step per batch

Invariants:
- every rank runs the same number of forward/backward passes per step (ranks with fewer micro-batches
  run zero-loss padding passes), so FSDP collectives line up;
- the loss of each micro-batch is its token sum divided by its mini-batch's loss tokens (all ranks; the
  whole batch's with one step per batch); FSDP's gradient averaging is undone by scaling with the world
  size, so N ranks give the 1-rank gradient;
- every rank takes the same optimizer steps (mini-batch sizes and counts are the same on every rank);
- packed samples never attend to each other: position_ids restart at 0 per sample and no attention mask
  is passed, so HF builds a block-diagonal causal mask (tested against per-sample forwards);
- a non-finite loss or grad norm raises before the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from prime_async.config.trainer import TrainerConfig
from prime_async.trainer import ckpt, lora, probe_reference, vision
from prime_async.trainer.loss import LossFn, build_loss_fn
from prime_async.trainer.mini_batches import OffPolicyClock, plan_mini_batches
from prime_async.trainer.optim import build_optimizer, build_scheduler
from prime_async.trainer.packed_rows import (
    check_micro_batch,
    packed_logprobs,
    sample_ids,
)
from prime_async.trainer.parallelize import parallelize
from prime_async.trainer.router_replay import RouterReplay
from prime_async.trainer.token_stats import TokenStats, reduce_device
from prime_async.transport.types import MicroBatch
from prime_async.transport.zmq_batches import RankBatch
from prime_async.utils.devices import model_device
from prime_async.utils.dtypes import resolve_dtype


def load_model(cfg: TrainerConfig, device: torch.device) -> torch.nn.Module:
    """The HF model of `cfg.model.path`: a causal LM, or a vision-language model (`trainer/vision.py`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = resolve_dtype(cfg.model.dtype, device)
    auto = AutoModelForImageTextToText if vision.is_vision_language(cfg.model.path) else AutoModelForCausalLM
    model = auto.from_pretrained(cfg.model.path, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device).train()


@dataclass
class RowTensors:
    """One packed micro-batch row as tensors on the model's device."""

    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    sampler_logp: torch.Tensor
    advantages: torch.Tensor
    sample_idx: torch.Tensor  # `packed_rows.sample_ids`: the packed sample of each token

    @staticmethod
    def of(mb: MicroBatch, device: torch.device) -> RowTensors:
        return RowTensors(
            ids=torch.from_numpy(np.array(mb.input_ids, dtype=np.int64)).to(device),
            pos=torch.from_numpy(np.array(mb.position_ids, dtype=np.int64)).to(device),
            mask=torch.from_numpy(np.array(mb.loss_mask)).to(device),
            sampler_logp=torch.from_numpy(np.array(mb.sampler_logprobs)).to(device),
            advantages=torch.from_numpy(np.array(mb.advantages)).to(device),
            sample_idx=torch.from_numpy(sample_ids(np.asarray(mb.position_ids))).to(device),
        )


def row_loss(
    row: RowTensors,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    *,
    loss_fn: LossFn,
    num_loss_tokens: int,
    effective_steps: np.ndarray | None = None,
    unknown_version: np.ndarray | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """The row's share of the (mini-)batch loss (differentiable) and its token statistics."""
    out = loss_fn(
        logp=logp,
        sampler_logp=row.sampler_logp,
        advantages=row.advantages,
        loss_mask=row.mask,
        num_loss_tokens=max(num_loss_tokens, 1),
        sample_ids=row.sample_idx,
    )
    sampler_logp = torch.where(row.mask, row.sampler_logp, logp.detach())
    stats = TokenStats.of(logp, sampler_logp, row.mask, out.masked, entropy, effective_steps, unknown_version)
    return out.loss, stats


def micro_batch_pass(
    model,
    mb: MicroBatch,
    *,
    loss_fn: LossFn,
    temperature: float,
    num_loss_tokens: int,
    grad_scale: float,
    effective_steps: np.ndarray | None = None,
    replay: RouterReplay | None = None,
    images: vision.RowVision | None = None,
) -> tuple[float, TokenStats]:
    """Forward + backward of one packed row; returns its (unscaled) loss share and token statistics.
    `replay`: MoE layers reuse the engine's routing of the row (`mb.routed_experts`), in the forward and
    in the backward too (activation checkpointing runs the forward again there); `images`: a
    vision-language model's row inputs (`trainer/vision.py`)."""
    row = RowTensors.of(mb, model_device(model))
    routes = mb.routed_experts if replay is not None else None
    extra = images.inputs(mb, row.ids.device) if images is not None else None
    placing = (
        images.placing(mb, row.ids.device) if extra is not None and images is not None else nullcontext()
    )
    with placing, replay.replaying(routes, row.ids.device) if replay is not None else nullcontext():
        logp, entropy = packed_logprobs(
            model, row.ids, row.pos, temperature, loss_mask=row.mask, vision=extra
        )
        loss, stats = row_loss(
            row, logp, entropy, loss_fn=loss_fn, num_loss_tokens=num_loss_tokens,
            effective_steps=effective_steps, unknown_version=mb.token_versions < 0,
        )  # fmt: skip
        (loss * grad_scale).backward()
    return float(loss.detach()), stats


@dataclass(frozen=True)
class PassSettings:
    """What every micro-batch pass of one batch shares."""

    loss_fn: LossFn
    temperature: float
    grad_scale: float  # world size under FSDP (undoes its gradient averaging), else 1
    max_grad_norm: float
    replay: RouterReplay | None = None  # MoE routing replay (`trainer.router_replay`)
    images: vision.RowVision | None = None  # a vision-language model's row inputs


@dataclass
class MiniBatchResult:
    loss_sum: float  # sum of the per-token losses (all ranks), i.e. the mini-batch loss times its tokens
    stats: TokenStats
    grad_norm: float


def mini_batch_step(
    model,
    optimizer,
    chunk: list[MicroBatch],
    *,
    num_loss_tokens: int,
    step: int,
    settings: PassSettings,
    distance: Callable[[MicroBatch], np.ndarray],
) -> MiniBatchResult:
    """Gradient accumulation over one mini-batch (its own loss normalizer), clip, checks, optimizer step;
    `distance(mb)` is the effective off-policy distance of each token of `mb`."""
    loss_sum, stats = 0.0, TokenStats.empty()
    for mb in chunk:
        loss, mb_stats = micro_batch_pass(
            model,
            mb,
            loss_fn=settings.loss_fn,
            temperature=settings.temperature,
            num_loss_tokens=num_loss_tokens,
            grad_scale=settings.grad_scale,
            effective_steps=distance(mb),
            replay=settings.replay,
            images=settings.images,
        )
        loss_sum += loss
        stats = stats.merge(mb_stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    loss_t = torch.tensor([loss_sum], dtype=torch.float64)
    if dist.is_initialized():
        loss_t = loss_t.to(reduce_device())
        dist.all_reduce(loss_t)
    if not (math.isfinite(grad_norm) and math.isfinite(float(loss_t))):
        raise RuntimeError(f"step {step}: non-finite loss {float(loss_t)} or grad norm {grad_norm}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return MiniBatchResult(float(loss_t) * num_loss_tokens, stats, grad_norm)


def train_step(
    model,
    optimizer,
    scheduler,
    batch: RankBatch,
    *,
    cfg: TrainerConfig,
    loss_fn,
    world_size: int,
    replay: RouterReplay | None = None,
    images: vision.RowVision | None = None,
) -> dict[str, float]:
    """`optim.num_steps_per_batch` mini-batch steps over this rank's micro-batches, then one LR step."""
    if batch.num_loss_tokens < 1:
        raise ValueError(f"batch {batch.step} has no loss tokens")
    micro_batches = list(batch.micro_batches)
    for mb in micro_batches:
        check_micro_batch(mb, cfg.seq_len, batch.step)
    micro_batches += [MicroBatch.padding()] * (batch.max_micro_batches - len(micro_batches))
    num_steps = cfg.optim.num_steps_per_batch
    clock = OffPolicyClock(batch.step, num_steps, batch.min_dispatch_version)
    settings = PassSettings(
        loss_fn=loss_fn,
        temperature=batch.temperature,
        grad_scale=float(world_size) if dist.is_initialized() else 1.0,
        max_grad_norm=cfg.optim.max_grad_norm,
        replay=replay,
        images=images,
    )
    plan = plan_mini_batches(micro_batches, num_steps, num_loss_tokens=batch.num_loss_tokens, step=batch.step)
    lr = optimizer.param_groups[0]["lr"]
    results: list[MiniBatchResult] = []
    for chunk, count in plan:
        if count == 0:  # no loss tokens on any rank: every rank skips it
            continue
        distance = partial(clock.distance, steps_taken=len(results))
        results.append(
            mini_batch_step(
                model,
                optimizer,
                chunk,
                num_loss_tokens=count,
                step=batch.step,
                settings=settings,
                distance=distance,
            )
        )
    scheduler.step()
    stats = TokenStats.empty()
    for r in results:
        stats = stats.merge(r.stats)
    return {
        "loss/total": sum(r.loss_sum for r in results) / batch.num_loss_tokens,
        **stats.all_reduce().metrics(),
        "optim/grad_norm": sum(r.grad_norm for r in results) / len(results),
        "optim/lr": lr,
        "optim/num_steps": len(results),
        **(replay.metrics() if replay is not None else {}),
    }


class FsdpBackend:
    """`TrainBackend` over an HF model: plain on one process, FSDP2-sharded under a process group."""

    def __init__(self, cfg: TrainerConfig, device: torch.device, world_size: int) -> None:
        self.cfg, self.world_size = cfg, world_size
        model = load_model(cfg, device)
        self.peft_model = None
        if cfg.lora is not None:  # adapters injected in place: `model` stays the module that is trained
            self.peft_model = lora.apply_lora(model, cfg.lora, cfg.model.path)
        self.replay = RouterReplay(model) if cfg.router_replay else None  # before FSDP wraps the layers
        self.images = (
            vision.RowVision(model, cfg.model.path) if vision.is_vision_language(cfg.model.path) else None
        )
        if self.images is not None and cfg.optim.vision_tower == "frozen":
            vision.freeze_vision_tower(model)
        mesh = None
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world_size,))
        self.model = parallelize(
            model,
            activation_checkpointing=cfg.runtime.activation_checkpointing,
            compile=cfg.runtime.compile,
            dp_mesh=mesh,
        )
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.max_steps)
        self.loss_fn = build_loss_fn(cfg.loss)

    def train_rank_batch(self, batch: RankBatch) -> dict[str, float]:
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            cfg=self.cfg,
            loss_fn=self.loss_fn,
            world_size=self.world_size,
            replay=self.replay,
            images=self.images,
        )

    def pretrained_config(self):
        return self.model.config

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        state = ckpt.full_model_state_dict(self.model)  # collective under FSDP; every rank gets it
        # a VLM's module names differ from its checkpoint's: publish the checkpoint's (SGLang reads those)
        return vision.checkpoint_names(state) if self.images is not None else state

    def probe_logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        return probe_reference.probe_logits(self.model, sequences)

    def lora_adapter(self) -> tuple[object, dict[str, torch.Tensor]] | None:
        """(PEFT config, adapter tensors in PEFT file naming) with LoRA, else None. Collective."""
        if self.peft_model is None:
            return None
        return self.peft_model.peft_config[lora.ADAPTER_NAME], lora.adapter_tensors(self.model)

    def save_checkpoint(self, *, output_dir: Path, step: int, keep: int | None) -> None:
        ckpt.save_checkpoint(
            output_dir=output_dir,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            keep=keep,
            trainable_only=self.peft_model is not None,
        )

    def load_checkpoint(self, path: Path) -> int:
        return ckpt.load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            trainable_only=self.peft_model is not None,
        )
