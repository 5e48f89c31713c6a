"""The megatron-core training backend: one object per rank that trains on `TrainBatch`es.

Called by the trainer loop when `trainer.backend = "megatron"` (`trainer/train.py` owns the loop: receiving
batches, metrics, publishing). This module owns only what differs from FSDP2:

    HF dir ──load_hf_weights──► GPTModel (TP/PP shards) ──megatron DDP──► distributed optimizer
    TrainBatch ─► this DP rank's micro-batches ─► megatron schedule (forward/backward, 1F1B when PP > 1)
             └─► per micro-batch: unpack ─► logits ─► logp ─► shared loss (`trainer/loss.py`)
    export_hf_state_dict() ─► HF names on global rank 0 ─► the same publisher as FSDP2

Invariants:
- the loss is the shared `build_loss_fn` (no copy): each micro-batch's loss is already its share of the
  batch loss (divided by the batch's loss tokens), so megatron must neither average over micro-batches nor
  over data-parallel ranks: `calculate_per_token_loss=True` makes DDP sum gradients, and the finalize hook
  is called without a token count;
- a non-finite gradient norm raises before the optimizer updates anything;
- every rank of one data-parallel replica (its TP and PP ranks) trains on the same micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from prime_async.config.megatron import MegatronConfig, read_hf_config, validate_megatron_setup
from prime_async.config.trainer import OptimConfig
from prime_async.trainer.loss import LossFn, TokenStats
from prime_async.trainer.megatron.batch import PaddedBatch, pack_logits, unpack
from prime_async.trainer.megatron.model import (
    build_gpt_model,
    export_hf_state_dict,
    init_parallel_state,
    load_hf_weights,
)
from prime_async.trainer.train import lr_factor, packed_logprobs
from prime_async.transport.types import MicroBatch

logger = logging.getLogger(__name__)


def replica_micro_batches(own: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches of this rank's data-parallel replica: the union of its model-parallel peers' shares.

    The orchestrator splits a batch into one share per trainer process; under TP/PP several processes form
    one replica and must run the same micro-batches, so their shares are gathered (in rank order, never
    re-packed). Replicas hold disjoint shares, so the union over replicas is the whole batch.
    """
    group = mpu.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return list(own)
    shares: list[list[MicroBatch] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, list(own), group=group)
    return [mb for share in shares for mb in share or []]


def padding_micro_batch() -> MicroBatch:
    """Two tokens, no loss token: keeps a replica without data in step with the collectives."""
    return MicroBatch(
        input_ids=np.zeros(2, dtype=np.int32),
        position_ids=np.arange(2, dtype=np.int32),
        loss_mask=np.zeros(2, dtype=np.bool_),
        advantages=np.zeros(2, dtype=np.float32),
        sampler_logprobs=np.zeros(2, dtype=np.float32),
        token_versions=np.full(2, -1, dtype=np.int32),
    )


class MegatronBackend:
    """Model, optimizer and train step of the megatron backend on this rank."""

    def __init__(
        self,
        *,
        megatron: MegatronConfig,
        model_path: str | Path,
        optim: OptimConfig,
        loss_fn: LossFn,
        dtype: torch.dtype,
        device: torch.device,
        max_steps: int | None = None,
    ) -> None:
        assert dist.is_initialized(), "MegatronBackend needs torch.distributed initialised (torchrun)"
        self.cfg, self.optim_cfg, self.loss_fn = megatron, optim, loss_fn
        self.device, self.max_steps = device, max_steps
        validate_megatron_setup(megatron, model_path)
        self.hf_config = read_hf_config(model_path)
        init_parallel_state(megatron)
        self.model = build_gpt_model(self.hf_config, megatron, dtype=dtype, device=device)
        load_hf_weights(self.model, model_path, self.hf_config, megatron)
        self.ddp = self._wrap_ddp()
        self.optimizer = self._build_optimizer(dtype)
        self._configure_schedule_hooks()
        logger.info(
            "megatron backend: tp=%d pp=%d dp=%d, %d local parameters",
            megatron.tensor_parallel_size,
            megatron.pipeline_parallel_size,
            mpu.get_data_parallel_world_size(),
            sum(p.numel() for p in self.model.parameters()),
        )

    def _wrap_ddp(self) -> DistributedDataParallel:
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=self.cfg.overlap_grad_reduce,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer,
        )
        return DistributedDataParallel(self.model.config, ddp_cfg, self.model)

    def _build_optimizer(self, dtype: torch.dtype):
        o = self.optim_cfg
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=o.max_grad_norm,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=self.cfg.use_distributed_optimizer,
        )
        return get_megatron_optimizer(opt_cfg, [self.ddp])

    def _configure_schedule_hooks(self) -> None:
        config = self.model.config
        # Our loss is already normalised by the batch's loss tokens: no division by micro-batches, and
        # DDP sums (instead of averaging) gradients over data-parallel ranks.
        config.calculate_per_token_loss = True
        config.finalize_model_grads_func = partial(_finalize_without_token_scaling)
        config.no_sync_func = self.ddp.no_sync
        config.grad_sync_func = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def _seq_multiple(self) -> int:
        return self.cfg.tensor_parallel_size if self.model.config.sequence_parallel else 1

    def _forward_step(self, data_iterator, model, *, temperature: float, num_loss_tokens: int):
        mb, padded = next(data_iterator)
        logits_bsv = model(padded.input_ids, padded.position_ids, attention_mask=padded.attention_mask)
        return logits_bsv, partial(self._loss, mb, padded, temperature, num_loss_tokens)

    def _loss(
        self, mb: MicroBatch, padded: PaddedBatch, temperature: float, num_loss_tokens: int, logits_bsv
    ):
        logits_tv = pack_logits(logits_bsv, padded, self.vocab_size)
        input_ids = torch.from_numpy(mb.input_ids.astype(np.int64)).to(self.device)
        # The FSDP path's own logits -> (logp, entropy) code, fed with our logits: one definition for both.
        logp, entropy = packed_logprobs(
            lambda **_: SimpleNamespace(logits=logits_tv[None]), input_ids, input_ids, temperature
        )
        loss_mask = torch.from_numpy(mb.loss_mask).to(self.device)
        sampler_logp = torch.from_numpy(mb.sampler_logprobs).to(self.device)
        out = self.loss_fn(
            logp=logp,
            sampler_logp=sampler_logp,
            advantages=torch.from_numpy(mb.advantages).to(self.device),
            loss_mask=loss_mask,
            num_loss_tokens=num_loss_tokens,
        )
        stats = TokenStats.of(
            logp.detach().cpu(), sampler_logp.cpu(), loss_mask.cpu(), out.masked.cpu(), entropy.cpu()
        )
        one = torch.ones((), dtype=torch.int, device=self.device)
        return out.loss, one, {"loss": out.loss.detach(), "stats": stats}

    def train_step(
        self, micro_batches: list[MicroBatch], *, num_loss_tokens: int, temperature: float, step: int
    ) -> dict[str, float]:
        """Forward/backward over this replica's micro-batches and one optimizer step; returns metrics.

        `num_loss_tokens` counts the loss tokens of the whole batch (all replicas), as in `RankBatch`.
        """
        if num_loss_tokens < 1:
            raise ValueError(f"batch {step} has no loss tokens")
        start = time.perf_counter()
        mbs = list(micro_batches) or [padding_micro_batch()]
        data = iter([(mb, unpack(mb, seq_multiple=self._seq_multiple(), device=self.device)) for mb in mbs])
        lr = self.optim_cfg.lr * lr_factor(self.optim_cfg, step, self.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = get_forward_backward_func()(
            forward_step_func=partial(
                self._forward_step, temperature=temperature, num_loss_tokens=num_loss_tokens
            ),
            data_iterator=data,
            model=[self.ddp],
            num_microbatches=len(mbs),
            seq_length=max(mb.num_tokens for mb in mbs),
            micro_batch_size=1,
            forward_only=False,
        )
        grad_norm = self._optimizer_step()
        return self._metrics(
            results, grad_norm, lr, sum(mb.num_tokens for mb in mbs), time.perf_counter() - start
        )

    def train_rank_batch(self, batch, step: int) -> dict[str, float]:
        """`train_step` on a `RankBatch` (this process's share), gathered over the model-parallel peers."""
        return self.train_step(
            replica_micro_batches(batch.micro_batches),
            num_loss_tokens=batch.num_loss_tokens,
            temperature=batch.temperature,
            step=step,
        )

    def _optimizer_step(self) -> float:
        # Check the norm before the update: megatron's step would apply a non-finite update when fp32/bf16.
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}; optimizer step skipped")
        ok, _, _ = self.optimizer.step()
        assert ok, "megatron optimizer reported an unsuccessful step"
        return grad_norm

    def _metrics(self, results: list[dict[str, Any]], grad_norm: float, lr: float, tokens: int, secs: float):
        loss = torch.zeros((), dtype=torch.float64)
        stats = TokenStats.empty()
        # Only the last pipeline stage computes losses; tensor-parallel ranks hold identical copies.
        if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0:
            for r in results:
                loss += r["loss"].double().cpu()
                stats = stats.merge(r["stats"])
        loss = _all_reduce_sum(loss, self.device)
        merged = _on_device(stats, self.device).all_reduce()
        return {
            "loss/total": float(loss),
            **merged.metrics(),
            "optim/grad_norm": grad_norm,
            "optim/lr": lr,
            "time/train": secs,
            "perf/tokens_per_s": tokens * mpu.get_data_parallel_world_size() / max(secs, 1e-9),
        }

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on global rank 0 (None elsewhere); every rank must call it."""
        return export_hf_state_dict(self.model, self.hf_config, self.cfg)


def _finalize_without_token_scaling(model, num_tokens, **kwargs) -> None:
    """megatron's grad finalisation (DP reduce, SP layernorm all-reduce, tied embeddings), unscaled."""
    megatron_finalize_model_grads(model, None, **kwargs)


def _all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return t
    out = t.to(device)  # NCCL reduces only GPU tensors
    dist.all_reduce(out)
    return out.cpu()


def _on_device(stats: TokenStats, device: torch.device) -> TokenStats:
    """TokenStats are built on the CPU; NCCL reduces only GPU tensors."""
    return TokenStats(*(getattr(stats, f.name).to(device) for f in dataclasses.fields(stats)))
