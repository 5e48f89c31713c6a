"""The megatron-core training backend: one object per rank that trains on `TrainBatch`es.

A `TrainBackend` (`trainer/backend.py`), built by the one trainer loop (`trainer/train.py`, which owns
receiving batches, metrics, publishing) when `trainer.backend = "megatron"`. This module owns only what
differs from FSDP2:

    HF dir ──load_hf_weights──► GPTModel (TP/PP shards) ──megatron DDP──► distributed optimizer
    TrainBatch ─► this DP rank's micro-batches ─► optim.num_steps_per_batch mini-batches
             (`trainer/mini_batches.py`), each: megatron schedule (forward/backward, 1F1B when PP > 1),
             then one optimizer step
             └─► per micro-batch: unpack ─► logits ─► logp ─► shared loss (`trainer/loss.py`)
    export_hf_state_dict() ─► HF names on global rank 0 ─► the same publisher as FSDP2

Invariants:
- the loss is the shared `build_loss_fn` (no copy): each micro-batch's loss is already its share of the
  mini-batch loss (divided by the mini-batch's loss tokens over all replicas; the batch's with one step per
  batch), so megatron must neither average over micro-batches nor
  over data-parallel ranks: `calculate_per_token_loss=True` (set when the model config is built, before
  DDP reads it) makes DDP sum gradients, and the finalize hook is called without a token count;
- a non-finite gradient norm raises before the optimizer updates anything;
- every rank of one data-parallel replica (its TP and PP ranks) trains on the same micro-batches;
- checkpoints (`trainer/megatron/checkpoint.py`) are sharded and layout-free: resume at another TP/PP/DP;
- without CUDA the ranks run on CPU over gloo (`cpu_ranks.enable_cpu_ranks`, installed before any model);
- every tensor fed to the model or its loss is built on the model's device (`_input_device`: where its
  parameters are, which megatron's DDP decides (`torch.cuda.current_device()`), not the `device` argument);
  collectives of host-side values go through `reduce_device()` (NCCL reduces only CUDA tensors).
"""

from __future__ import annotations

import logging
import math
import socket
from functools import partial
from pathlib import Path
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
from prime_async.config.trainer import OptimConfig, TrainerConfig
from prime_async.trainer.loss import LossFn, build_loss_fn
from prime_async.trainer.megatron.batch import PaddedBatch, pack_logits, pad_to, unpack
from prime_async.trainer.megatron.checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
from prime_async.trainer.megatron.cpu_ranks import enable_cpu_ranks
from prime_async.trainer.megatron.model import (
    build_gpt_model,
    export_hf_state_dict,
    init_parallel_state,
    load_hf_weights,
)
from prime_async.trainer.mini_batches import OffPolicyClock, plan_mini_batches
from prime_async.trainer.optim import lr_factor
from prime_async.trainer.packed_rows import logit_rows, sample_ids, scatter_rows
from prime_async.trainer.token_stats import TokenStats, reduce_device
from prime_async.transport.types import MicroBatch
from prime_async.transport.zmq_batches import RankBatch
from prime_async.utils.devices import model_device, on_model
from prime_async.utils.dtypes import resolve_dtype

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


def init_single_process_group(device: torch.device) -> None:
    """megatron-core needs a process group even at world size 1 (outside torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


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
        self.device, self.max_steps, self.model_path = device, max_steps, model_path
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

    @classmethod
    def from_config(cls, cfg: TrainerConfig, device: torch.device) -> MegatronBackend:
        """The backend of the trainer loop (CPU ranks over gloo when the device is the CPU)."""
        if device.type == "cpu":
            enable_cpu_ranks()
        if not dist.is_initialized():
            init_single_process_group(device)
        return cls(
            megatron=cfg.megatron,
            model_path=cfg.model.path,
            optim=cfg.optim,
            loss_fn=build_loss_fn(cfg.loss),
            dtype=resolve_dtype(cfg.model.dtype, device),
            device=device,
            max_steps=cfg.max_steps,
        )

    def _wrap_ddp(self) -> DistributedDataParallel:
        # DDP picks its gradient scaling (sum vs. average over data-parallel ranks) in its constructor.
        assert self.model.config.calculate_per_token_loss, "DDP would average gradients over DP ranks"
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
        # `calculate_per_token_loss` (set in `transformer_config`): no division by micro-batches, DDP sums
        # gradients; the finalize hook must not divide by a token count either.
        config.finalize_model_grads_func = partial(_finalize_without_token_scaling)
        config.no_sync_func = self.ddp.no_sync
        config.grad_sync_func = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def _input_device(self) -> torch.device:
        """Where the model's inputs go: its parameters' device (after DDP moved them into its buffers)."""
        return model_device(self.model)

    def unpack(self, mb: MicroBatch) -> PaddedBatch:
        """`mb` as the model's (B, S) input batch, on the model's device."""
        return unpack(mb, seq_multiple=self._seq_multiple(), device=self._input_device())

    def _seq_multiple(self) -> int:
        return self.cfg.tensor_parallel_size if self.model.config.sequence_parallel else 1

    def _forward_step(self, data_iterator, model, *, temperature: float, num_loss_tokens: int, distance):
        mb, padded = next(data_iterator)
        logits_bsv = model(padded.input_ids, padded.position_ids, attention_mask=padded.attention_mask)
        return logits_bsv, partial(self._loss, mb, padded, temperature, num_loss_tokens, distance(mb))

    def _loss(
        self,
        mb: MicroBatch,
        padded: PaddedBatch,
        temperature: float,
        num_loss_tokens: int,
        effective_steps: np.ndarray,
        logits_bsv,
    ):
        logits_tv = pack_logits(logits_bsv, padded, self.vocab_size)
        device = self._input_device()
        input_ids = on_model(device, mb.input_ids.astype(np.int64))
        loss_mask = on_model(device, mb.loss_mask)
        # The FSDP path's own logits -> (logp, entropy) code, fed with our logits: one definition for both.
        rows = logit_rows(input_ids.shape[0], loss_mask, device)
        logp, entropy = scatter_rows(logits_tv[rows], rows, input_ids, temperature)
        sampler_logp = on_model(device, mb.sampler_logprobs)
        out = self.loss_fn(
            logp=logp,
            sampler_logp=sampler_logp,
            advantages=on_model(device, mb.advantages),
            loss_mask=loss_mask,
            num_loss_tokens=num_loss_tokens,
            sample_ids=on_model(device, sample_ids(mb.position_ids)),
        )
        stats = TokenStats.of(
            logp.detach().cpu(),
            sampler_logp.cpu(),
            loss_mask.cpu(),
            out.masked.cpu(),
            entropy.cpu(),
            effective_steps,
            mb.token_versions < 0,
        )
        one = torch.ones((), dtype=torch.int, device=device)
        loss_sum = out.loss.detach() * num_loss_tokens  # the token sum: mini-batches are summed by it
        return out.loss, one, {"loss_sum": loss_sum, "stats": stats}

    def _forward_backward(
        self, mbs: list[MicroBatch], *, num_loss_tokens: int, temperature: float, distance
    ) -> list[dict[str, Any]]:
        """Forward/backward of one mini-batch (a padding row if this replica has none of it)."""
        mbs = mbs or [MicroBatch.padding()]
        padded = [self.unpack(mb) for mb in mbs]
        if mpu.get_expert_model_parallel_world_size() > 1:
            mbs, padded = self._align_over_expert_ranks(mbs, padded)
        data = iter(list(zip(mbs, padded, strict=True)))
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return get_forward_backward_func()(
            forward_step_func=partial(
                self._forward_step,
                temperature=temperature,
                num_loss_tokens=num_loss_tokens,
                distance=distance,
            ),
            data_iterator=data,
            model=[self.ddp],
            num_microbatches=len(mbs),
            seq_length=max(mb.num_tokens for mb in mbs),
            micro_batch_size=1,
            forward_only=False,
        )

    def _align_over_expert_ranks(
        self, mbs: list[MicroBatch], padded: list[PaddedBatch]
    ) -> tuple[list[MicroBatch], list[PaddedBatch]]:
        """The same number of micro-batches, each of the same (B, S), on every expert-parallel rank:
        megatron's allgather token dispatcher gathers every rank's tokens of each MoE layer and needs equal
        sizes (padding rows and padding tokens add nothing to the loss)."""
        group = mpu.get_expert_model_parallel_group()
        count = torch.tensor([len(mbs)], device=reduce_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        while len(mbs) < int(count):
            mbs = [*mbs, MicroBatch.padding()]
            padded = [*padded, self.unpack(mbs[-1])]
        shapes = torch.tensor([list(p.input_ids.shape) for p in padded], device=reduce_device())
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
        return mbs, [pad_to(p, int(b), int(s)) for p, (b, s) in zip(padded, shapes.tolist(), strict=True)]

    def train_step(
        self,
        micro_batches: list[MicroBatch],
        *,
        num_loss_tokens: int,
        temperature: float,
        step: int,
        min_dispatch_version: int | None = None,
    ) -> dict[str, float]:
        """`optim.num_steps_per_batch` mini-batch steps over this replica's micro-batches; returns metrics.

        `num_loss_tokens` counts the loss tokens of the whole batch (all replicas), as in `RankBatch`;
        `min_dispatch_version` (default `step`) stands in for unknown token versions."""
        if num_loss_tokens < 1:
            raise ValueError(f"batch {step} has no loss tokens")
        num_steps = self.optim_cfg.num_steps_per_batch
        fallback = step if min_dispatch_version is None else min_dispatch_version
        clock = OffPolicyClock(step, num_steps, fallback)
        lr = self.optim_cfg.lr * lr_factor(self.optim_cfg, step, self.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        plan = plan_mini_batches(
            list(micro_batches),
            num_steps,
            num_loss_tokens=num_loss_tokens,
            step=step,
            group=mpu.get_data_parallel_group(),
        )
        results: list[dict[str, Any]] = []
        grad_norms: list[float] = []
        for chunk, count in plan:
            if count == 0:  # no loss tokens in any replica: every rank skips it
                continue
            distance = partial(clock.distance, steps_taken=len(grad_norms))
            results += self._forward_backward(
                chunk, num_loss_tokens=count, temperature=temperature, distance=distance
            )
            grad_norms.append(self._optimizer_step())
        return self._metrics(results, grad_norms, lr, num_loss_tokens)

    def train_rank_batch(self, batch: RankBatch) -> dict[str, float]:
        """`train_step` on a `RankBatch` (this process's share), gathered over the model-parallel peers."""
        return self.train_step(
            replica_micro_batches(batch.micro_batches),
            num_loss_tokens=batch.num_loss_tokens,
            temperature=batch.temperature,
            step=batch.step,
            min_dispatch_version=batch.min_dispatch_version,
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

    def _metrics(
        self, results: list[dict[str, Any]], grad_norms: list[float], lr: float, num_loss_tokens: int
    ) -> dict[str, float]:
        loss = torch.zeros((), dtype=torch.float64)
        stats = TokenStats.empty()
        # Only the last pipeline stage computes losses; tensor-parallel ranks hold identical copies.
        if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0:
            for r in results:
                loss += r["loss_sum"].double().cpu()
                stats = stats.merge(r["stats"])
        loss = _all_reduce_sum(loss)
        merged = stats.all_reduce()  # moves its tensors to `reduce_device()` itself
        return {
            "loss/total": float(loss) / num_loss_tokens,
            **merged.metrics(),
            "optim/grad_norm": sum(grad_norms) / len(grad_norms),
            "optim/lr": lr,
            "optim/num_steps": len(grad_norms),
        }

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights on global rank 0 (None elsewhere); every rank must call it."""
        return export_hf_state_dict(self.model, self.hf_config, self.cfg)

    def probe_logits(self, sequences: list[list[int]]) -> list[torch.Tensor] | None:
        """None: the weight probe (`weights/probe.py`) is not wired for Megatron's model."""
        return None

    def pretrained_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_path)

    def save_checkpoint(self, *, output_dir: Path, step: int, keep: int | None) -> None:
        layout = {
            "tp": self.cfg.tensor_parallel_size,
            "pp": self.cfg.pipeline_parallel_size,
            "dp": mpu.get_data_parallel_world_size(),
        }
        save_megatron_checkpoint(
            model=self.model,
            optimizer=self.optimizer,
            output_dir=output_dir,
            step=step,
            keep=keep,
            model_path=str(self.model_path),
            layout=layout,
        )

    def load_checkpoint(self, path: Path) -> int:
        return load_megatron_checkpoint(path, model=self.model, optimizer=self.optimizer)


def _finalize_without_token_scaling(model, num_tokens, **kwargs) -> None:
    """megatron's grad finalisation (DP reduce, SP layernorm all-reduce, tied embeddings), unscaled."""
    megatron_finalize_model_grads(model, None, **kwargs)


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return t
    out = t.to(reduce_device())  # NCCL reduces only GPU tensors
    dist.all_reduce(out)
    return out.cpu()
