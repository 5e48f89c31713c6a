"""Trainer main loop for `trainer.backend = "megatron"`: the FSDP loop's contract, megatron's model.

    BatchReceiver.receive(n) (this process's share) ──► MegatronBackend.train_rank_batch (replica gathers
    its model-parallel peers' shares) ──► export HF weights (TP all-gather, PP gather) ──► publish
    broadcasts/step_{n+1}/ on rank 0 (the FSDP path's `WeightPublisher`) ──► metrics (rank 0)

`trainer/train.py::run` hands over here when `cfg.backend == "megatron"`. Everything upstream (batches,
transport, loss, publisher, metric names) is shared with the FSDP path.

Invariants: step n consumes batch n exactly once and publishes v_{n+1}; the staleness re-check is the same
as FSDP's; full-state checkpoints (`ckpt.interval`, `resume`) are not implemented for this backend and are
refused before anything starts.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from prime_async.config.trainer import TrainerConfig
from prime_async.trainer.loss import build_loss_fn
from prime_async.trainer.megatron.backend import MegatronBackend
from prime_async.trainer.step_metrics import build_monitor, run_steps, timing_metrics
from prime_async.trainer.train import check_staleness, setup_distributed
from prime_async.trainer.weights import WeightPublisher
from prime_async.transport.zmq_batches import BatchReceiver

logger = logging.getLogger(__name__)


def _init_single_process_group(device: torch.device) -> None:
    """megatron-core needs a process group even at world size 1 (outside torchrun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]


class MegatronTrainer:
    """Owns the backend, receiver, publisher and monitor; `run()` is the loop."""

    def __init__(self, *, cfg: TrainerConfig) -> None:
        if cfg.resume or cfg.ckpt.interval is not None:
            raise ValueError(
                "trainer.backend = 'megatron' has no checkpoints yet: unset ckpt.interval and resume"
            )
        self.cfg = cfg
        self.rank, self.world_size, self.device = setup_distributed()
        if not dist.is_initialized():
            _init_single_process_group(self.device)
        torch.set_num_threads(cfg.threads or (1 if self.device.type == "cpu" else torch.get_num_threads()))
        torch.manual_seed(cfg.seed)
        self.backend = MegatronBackend(
            megatron=cfg.megatron,
            model_path=cfg.model.path,
            optim=cfg.optim,
            loss_fn=build_loss_fn(cfg.loss),
            dtype=_dtype(cfg, self.device),
            device=self.device,
            max_steps=cfg.max_steps,
        )
        self.step = 0
        self.publisher = self._build_publisher() if self.rank == 0 else None
        self.monitor = build_monitor(cfg) if self.rank == 0 else None
        self.receiver = BatchReceiver(cfg=cfg.transport, rank=self.rank, world_size=self.world_size)

    def _build_publisher(self) -> WeightPublisher:
        from transformers import AutoConfig

        return WeightPublisher(
            output_dir=self.cfg.output_dir,
            model_config=AutoConfig.from_pretrained(self.cfg.model.path),
            source_dir=Path(self.cfg.model.path),
            keep_last=self.cfg.weights.keep_last,
        )

    def run_step(self) -> dict[str, float]:
        n = self.step
        t0 = time.perf_counter()
        batch = self.receiver.receive(n)
        t1 = time.perf_counter()
        check_staleness(batch, self.cfg.max_off_policy_steps)
        metrics = self.backend.train_rank_batch(batch, step=n)
        t2 = time.perf_counter()
        state = self.backend.hf_state_dict()  # collective over all ranks
        if self.publisher is not None:
            self.publisher.publish(state, n + 1)
        t3 = time.perf_counter()
        self.step = n + 1
        metrics.update(timing_metrics(batch, t_start=t0, t_batch=t1, t_trained=t2, t_published=t3))
        return metrics

    @property
    def max_steps(self) -> int | None:
        return self.cfg.max_steps

    def run(self) -> None:
        run_steps(self, logger)


def run_megatron(cfg: TrainerConfig) -> None:
    """Train with the megatron backend until `cfg.max_steps`; tears down the process group at the end."""
    try:
        MegatronTrainer(cfg=cfg).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
