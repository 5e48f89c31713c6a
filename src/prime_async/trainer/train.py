"""The trainer loop, one for every backend: batch n in over ZeroMQ, trained, weights v_{n+1} out.

    BatchReceiver.receive(n) ──► staleness check ──► teacher term (`opd.py`, distillation only)
         (waits: time/wait_for_batch)                            │
                                   backend.train_rank_batch (`TrainBackend`: FSDP2 in `fsdp.py`,
                                   megatron-core in `megatron/backend.py`)
                                                                 │
  checkpoint every ckpt.interval ◄── metrics (rank 0) ◄── publish broadcasts/step_{n+1}/ (rank 0)

Run as `trainer @ trainer.toml` (`entrypoints/trainer.py` calls `run`) or under
`torchrun --nproc-per-node N -m prime_async.entrypoints.trainer` (gloo on CPU / nccl on GPU).

Invariants:
- step n consumes batch n exactly once (the receiver raises on any other step), and publishes v_{n+1},
  once, after all of its `optim.num_steps_per_batch` optimizer steps;
- no batch with a group dispatched at a version the trainer has not made, or older than
  `max_off_policy_steps`, is trained (defence in depth behind the orchestrator's sink);
- the loop imports a backend only through `build_backend` (megatron lazily): backends never import the loop.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from prime_async.config.placement import ranks_vs_devices
from prime_async.config.trainer import TrainerConfig
from prime_async.health.watch import HealthWatch
from prime_async.trainer.backend import TrainBackend
from prime_async.trainer.ckpt import checkpoint_steps, latest_checkpoint
from prime_async.trainer.opd import apply_teacher_advantage
from prime_async.trainer.packed_rows import samples_with_loss
from prime_async.trainer.probe_reference import ProbeBuilder
from prime_async.trainer.step_metrics import build_monitor, log_step, timing_metrics
from prime_async.trainer.token_stats import reduce_device
from prime_async.transport.zmq_batches import BatchReceiver, RankBatch
from prime_async.utils.devices import cuda_device_count
from prime_async.utils.mem_fraction import apply_mem_fraction
from prime_async.utils.stall import StallWatch
from prime_async.weights.probe import ProbeReference
from prime_async.weights.publishers import WeightPublisher, Weights, build_publisher
from prime_async.weights.writer import BroadcastWriter

logger = logging.getLogger(__name__)


def check_ranks_fit_devices(num_processes: int, visible: int) -> None:
    """Refuse `num_processes` trainer ranks on this node when CUDA shows fewer devices (rank r would ask for
    `cuda:r`: "invalid device ordinal" deep inside torch). One line (`config.placement.ranks_vs_devices`,
    the message `rl`'s placement gives too). `visible == 0` means no CUDA: CPU ranks always fit."""
    message = ranks_vs_devices(num_processes, visible, where="visible to this process") if visible else None
    if message is not None:
        raise ValueError(message)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Init the process group under torchrun; returns (rank, world_size, device).

    On CUDA rank r of a node uses `cuda:LOCAL_RANK`: more ranks on the node than visible devices are refused
    here, in one line naming `trainer.num_processes` (`check_ranks_fit_devices`), before any rank asks
    torch for a device ordinal that does not exist."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    check_ranks_fit_devices(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), cuda_device_count())
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return rank, world_size, device


def set_deterministic(device: torch.device) -> None:
    """Deterministic torch kernels (`deterministic = true`); call before the first CUDA matmul."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def build_backend(cfg: TrainerConfig, device: torch.device, world_size: int) -> TrainBackend:
    if cfg.backend == "megatron":  # optional extra: imported only when chosen
        from prime_async.trainer.megatron.backend import MegatronBackend

        return MegatronBackend.from_config(cfg, device)
    from prime_async.trainer.fsdp import FsdpBackend

    return FsdpBackend(cfg, device, world_size)


def check_staleness(batch: RankBatch, max_off_policy_steps: int | None) -> None:
    """Defence in depth behind the train sink's sweep: no group older than K versions is trained."""
    if batch.max_dispatch_version > batch.step:
        raise RuntimeError(
            f"batch {batch.step} holds a group dispatched at version {batch.max_dispatch_version}: staleness "
            f"{batch.step - batch.max_dispatch_version} < 0 (generated by weights this trainer has not made)"
        )
    k = max_off_policy_steps
    if k is not None and batch.step - batch.min_dispatch_version > k:
        raise RuntimeError(
            f"batch {batch.step} holds a group dispatched at version {batch.min_dispatch_version}: "
            f"staleness {batch.step - batch.min_dispatch_version} > max_off_policy_steps={k}"
        )


def trained_samples(batch: RankBatch) -> int:
    """`loss/num_samples`: trajectories of the whole batch holding at least one loss token, counted by the
    trainer from the rows it received (each rank its own rows, summed over ranks): a count of what reached
    the trainer that owes nothing to the orchestrator's ledger. Collective: every rank calls it."""
    count = sum(samples_with_loss(mb) for mb in batch.micro_batches)
    if not dist.is_initialized():
        return count
    total = torch.tensor([count], dtype=torch.float64, device=reduce_device())
    dist.all_reduce(total)
    return int(total.item())


class Trainer:
    """Owns the backend, receiver, publisher and monitor; `run()` is the loop."""

    def __init__(self, *, cfg: TrainerConfig):
        self.cfg = cfg
        self.rank, self.world_size, self.device = setup_distributed()
        apply_mem_fraction(cfg.runtime.mem_fraction, self.device, who="trainer")
        if cfg.deterministic:
            set_deterministic(self.device)
        torch.set_num_threads(
            cfg.runtime.threads or (1 if self.device.type == "cpu" else torch.get_num_threads())
        )
        torch.manual_seed(cfg.runtime.seed)
        self.backend = build_backend(cfg, self.device, self.world_size)
        self._probe: ProbeBuilder | None = None  # the weight probe, built at the first publish
        self.step = self._maybe_resume()
        self.publisher = self._build_publisher() if self.rank == 0 else None
        self.monitor = build_monitor(cfg, name=self.metrics_name) if self.rank == 0 else None
        watch = self.rank == 0 and self.health_alarms and cfg.health.enabled
        self.health = HealthWatch(cfg.health) if watch else None
        self.receiver = self.batch_source()
        self.stalls = StallWatch(
            component="trainer" if self.rank == 0 else f"trainer-rank{self.rank}",
            output_dir=Path(cfg.output_dir), stall_after_s=cfg.log.stall_after_s,
            describe=lambda: {"step": self.step, "rank": self.rank, "world_size": self.world_size},
        ).start()  # fmt: skip

    metrics_name = "trainer"  # metrics/<name>.jsonl
    health_alarms = True  # `health/*` (rank 0, `cfg.health`); sft lowers entropy by design, has no reward

    def batch_source(self) -> BatchReceiver:
        """Where batch n comes from: the orchestrator's stream (`sft` overrides it with its data)."""
        return BatchReceiver(cfg=self.cfg.transport, rank=self.rank, world_size=self.world_size)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics to the monitor and its console line (rank 0)."""
        if self.monitor is not None:
            self.monitor.log(metrics, step=step)
            log_step(logger, step, metrics)

    def _maybe_resume(self) -> int:
        if not self.cfg.ckpt.resume:
            return 0
        path = latest_checkpoint(self.cfg.output_dir)
        if path is None:
            raise ValueError(
                f"resume=true but no complete checkpoint under {self.cfg.output_dir}/checkpoints/trainer"
            )
        return self.backend.load_checkpoint(path)

    def _build_writer(self) -> BroadcastWriter:
        source = Path(self.cfg.model.path)
        if not source.is_dir():  # hub id: save its tokenizer once so every version carries it
            from transformers import AutoTokenizer

            source = Path(self.cfg.output_dir) / "tokenizer"
            AutoTokenizer.from_pretrained(self.cfg.model.path).save_pretrained(source)
        return BroadcastWriter(
            output_dir=self.cfg.output_dir,
            model_config=self.backend.pretrained_config(),
            source_dir=source,
            keep_last=self.cfg.weights.keep_last,
        )

    def _build_publisher(self) -> WeightPublisher:
        """Rank 0's publisher of `weights.transport` (or of LoRA adapters), `weights/publishers/`."""
        writer = self._build_writer()
        tied = bool(getattr(writer.model_config, "tie_word_embeddings", False))
        return build_publisher(self.cfg, writer, self.device, tied=tied)

    def collect_weights(self) -> Weights | None:
        """What travels, gathered from every rank (collective): the LoRA adapter, else the full HF
        weights; None on the ranks the backend gives nothing."""
        if self.cfg.lora is not None:
            config, tensors = self.backend.lora_adapter()
            return Weights(tensors, adapter_config=config)
        state = self.backend.hf_state_dict()
        return Weights(state) if state is not None else None

    def probe_reference(self) -> ProbeReference | None:
        """The weight probe's reference of the current parameters (collective; `weights/probe.py`), None
        when the probe is off, for LoRA runs (engines score the base model) or a backend without it."""
        probe = self.cfg.weights.probe
        if not probe.enabled or self.cfg.lora is not None:
            return None
        if self._probe is None:
            self._probe = ProbeBuilder.from_model_path(probe, self.cfg.model.path)
        logits = self.backend.probe_logits(self._probe.sequences)
        return self._probe.reference(logits) if logits is not None else None

    def publish(self, version: int) -> None:
        reference = self.probe_reference()  # collective; the parameters being published
        weights = self.collect_weights()  # collective over all ranks
        if self.publisher is not None:  # rank 0; announced on the control channel
            assert weights is not None, "the backend returned no weights on rank 0"
            if reference is not None:
                self.publisher.attach_probe(version, reference)
            protected = checkpoint_steps(self.cfg.output_dir, warn=False)
            interval = self.cfg.ckpt.interval
            on_disk = version == self.cfg.max_steps or (interval is not None and version % interval == 0)
            self.publisher.publish(weights, version, protected=protected, on_disk=on_disk)

    def run_step(self) -> dict[str, float]:
        n = self.step
        t0 = time.perf_counter()
        with self.stalls.waiting(f"batch {n}", peer="the orchestrator"):
            batch = self.receiver.receive(n)
        t1 = time.perf_counter()
        check_staleness(batch, self.cfg.max_off_policy_steps)
        metrics = self.backend.train_rank_batch(apply_teacher_advantage(batch))
        metrics["loss/num_samples"] = float(trained_samples(batch))
        t2 = time.perf_counter()
        with self.stalls.waiting(f"weights v{n + 1} to publish", peer=f"the weight writer (v{n} first)"):
            self.publish(n + 1)
        t3 = time.perf_counter()
        self.step = n + 1
        metrics.update(timing_metrics(batch, t_start=t0, t_batch=t1, t_trained=t2, t_published=t3))
        if self.publisher is not None and self.publisher.last_write_s is not None:
            metrics["time/write_weights"] = self.publisher.last_write_s  # the last finished write
        if self.health is not None:  # the batch carries the orchestrator's signals (`health_inputs`)
            metrics.update(self.health.observe(n, {**batch.metrics, **metrics}))
        return metrics

    def maybe_checkpoint(self) -> None:
        """Checkpoint `self.step` when it is a checkpoint step. Called after the step's metrics are logged,
        so a kill between the two never leaves a checkpointed step without its metrics row (it may leave
        one logged twice: the step is trained again after the restart)."""
        if self.cfg.ckpt.interval is None or self.step % self.cfg.ckpt.interval != 0:
            return
        if self.publisher is not None:  # a restart from this checkpoint loads its version
            with self.stalls.waiting(f"weights v{self.step} to be written", peer="the weight writer"):
                self.publisher.flush()
        self.backend.save_checkpoint(output_dir=self.cfg.output_dir, step=self.step, keep=self.cfg.ckpt.keep)

    def run(self) -> None:
        """Train until `max_steps` (forever if None), logging each step; always closes receiver, monitor."""
        try:
            while self.cfg.max_steps is None or self.step < self.cfg.max_steps:
                n = self.step
                self.log_step(n, self.run_step())
                self.maybe_checkpoint()
                if self.health is not None:
                    self.health.raise_if_stopping(n)
            if self.publisher is not None:  # the last version is written and announced before exit
                with self.stalls.waiting(f"weights v{self.step} to be written", peer="the weight writer"):
                    self.publisher.flush()
        finally:
            self.stalls.stop()
            self.receiver.close()
            if self.publisher is not None:
                self.publisher.close()
            if self.monitor is not None:
                self.monitor.close()


def run(cfg: TrainerConfig) -> None:
    """Train until `cfg.max_steps` (or forever); tears down the process group at the end."""
    try:
        Trainer(cfg=cfg).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
