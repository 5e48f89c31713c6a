"""`uv run sft`: the trainer loop (`trainer/train.py::Trainer`) with batches from data instead of the
orchestrator, and the NLL loss instead of the importance-ratio loss.

Everything else is the trainer's: backend (fsdp or megatron, LoRA), checkpoints and resume (the data
position is the step, `sft/batches.py`), weight publishing (`broadcasts/step_n`, so `eval` and a running
engine can load any version), stall watch. At the end the last version is copied to `final_model_dir`, a
full model directory that `rl`, `eval` or another `sft` start from (with LoRA: the adapter merged into the
base model, as `export-lora` does).

Invariants: each step's metrics keep the trainer's names where they mean the same (`loss/total` is the mean
NLL per trained token, `entropy`, `optim/*`, `perf/*`, `time/*`); the importance-ratio metrics, which
mean nothing without a sampler, are left out; `sft/perplexity` = exp(`loss/total`).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from prime_async.config.sft import SFTConfig
from prime_async.sft.batches import SFTBatches, usable_examples
from prime_async.sft.data import load_chats
from prime_async.sft.render import ChatRenderer
from prime_async.trainer.loss import nll_loss
from prime_async.trainer.train import Trainer

logger = logging.getLogger(__name__)

RL_ONLY_METRICS = ("mismatch_kl", "ratio/", "masked_fraction", "offpolicy/")


class SFTTrainer(Trainer):
    metrics_name = "sft"
    health_alarms = False  # SFT lowers entropy by design and has no reward: no `health/*`

    def __init__(self, *, cfg: SFTConfig):
        if cfg.runtime.threads is None and int(os.environ.get("WORLD_SIZE", "1")) == 1:  # alone: every core
            runtime = cfg.runtime.model_copy(update={"threads": os.cpu_count()})
            cfg = cfg.model_copy(update={"runtime": runtime})
        self.sft_cfg = cfg
        super().__init__(cfg=cfg)
        self.backend.loss_fn = nll_loss

    def batch_source(self) -> SFTBatches:
        cfg = self.sft_cfg
        renderer = ChatRenderer(cfg.model.path, cfg.data.train_on)
        chats = load_chats(cfg.data)
        examples = usable_examples([renderer.render(c) for c in chats], cfg.seq_len)
        trained = sum(sum(ex.loss_mask) for ex in examples)
        logger.info("sft: %d examples (%d trained tokens), renderer %s, %d per step: %.2f epochs in %d steps",
                    len(examples), trained, renderer.name, cfg.data.batch_size,
                    cfg.max_steps * cfg.data.batch_size / len(examples), cfg.max_steps)  # fmt: skip
        return SFTBatches(
            examples, batch_size=cfg.data.batch_size, seed=cfg.data.shuffle_seed, seq_len=cfg.seq_len,
            rank=self.rank, world_size=self.world_size,
        )  # fmt: skip

    def publish(self, version: int) -> None:
        """Every `publish_interval` versions and the last (the same on every rank: it is collective)."""
        if version % self.sft_cfg.publish_interval == 0 or version == self.cfg.max_steps:
            super().publish(version)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.monitor is None:
            return
        metrics = {k: v for k, v in metrics.items() if not k.startswith(RL_ONLY_METRICS)}
        metrics["sft/perplexity"] = math.exp(min(metrics["loss/total"], 50.0))
        metrics["sft/epoch"] = self.receiver.epoch_of(step)
        self.monitor.log(metrics, step=step)
        logger.info(
            "step %d | loss %.4f | ppl %.2f | grad_norm %.3f | %.0f tok/s | epoch %.2f",
            step, metrics["loss/total"], metrics["sft/perplexity"], metrics["optim/grad_norm"],
            metrics["perf/sample_tokens_per_s"], metrics["sft/epoch"],
        )  # fmt: skip

    def copy_final(self) -> Path | None:
        """Copy the last published version to `final_model_dir` (rank 0); returns it."""
        if self.rank != 0:
            return None
        source = Path(self.cfg.output_dir) / "broadcasts" / f"step_{self.step}"
        target = self.sft_cfg.final_model_dir
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if self.cfg.lora is not None:  # a full model directory all the same: the adapter merged in
            from prime_async.config.export import ExportLoraConfig
            from prime_async.trainer.export import run as export_lora

            export_lora(ExportLoraConfig(adapter=source, output=tmp, base=self.cfg.model.path))
        else:
            shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("STABLE"))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        logger.info("sft: version %d copied to %s (load it as model.path)", self.step, target)
        return target


def run(cfg: SFTConfig) -> None:
    """Train `cfg.max_steps` SFT steps, then copy the final version; tears down the process group."""
    try:
        trainer = SFTTrainer(cfg=cfg)
        trainer.run()
        trainer.copy_final()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
