"""Per-step metrics of the trainer loop (`trainer/train.py`): timings, the console line, the monitor."""

from __future__ import annotations

import logging
from typing import Any

from prime_async.transport.zmq_batches import RankBatch


def timing_metrics(
    batch: RankBatch, *, t_start: float, t_batch: float, t_trained: float, t_published: float
) -> dict[str, float]:
    """`time/*`, `perf/tokens_per_s` (tokens the model ran, whole batch, all ranks),
    `perf/sample_tokens_per_s` (episode tokens trained: a shared prompt counts once per episode, as if
    unshared; equal to the former without shared prefixes), the batch's loss-token count, and the
    orchestrator's `batch/*` metrics of the batch trained (`batch/lifetime_start`: which lifetime of the
    orchestrator cut it)."""
    num_tokens = sum(sum(rank) for rank in batch.layout)
    seconds = max(t_trained - t_batch, 1e-9)
    return {
        **{name: value for name, value in batch.metrics.items() if name.startswith("batch/")},
        "time/wait_for_batch": t_batch - t_start,
        "time/train": t_trained - t_batch,
        "time/publish_weights": t_published - t_trained,
        "perf/tokens_per_s": num_tokens / seconds,
        "perf/sample_tokens_per_s": batch.metrics.get("batch/sample_tokens", num_tokens) / seconds,
        "loss/num_loss_tokens": batch.num_loss_tokens,
    }


def log_step(logger: logging.Logger, step: int, metrics: dict[str, Any]) -> None:
    """One console line per step: loss, mismatch KL, entropy (when computed), grad norm, episode tokens/s."""
    entropy = f" | entropy {metrics['entropy']:.3f}" if "entropy" in metrics else ""
    logger.info(
        "step %d | loss %.4f | mismatch_kl %.2e%s | grad_norm %.3f | %.0f tok/s",
        step,
        metrics["loss/total"],
        metrics["mismatch_kl"],
        entropy,
        metrics["optim/grad_norm"],
        metrics.get("perf/sample_tokens_per_s", metrics["perf/tokens_per_s"]),
    )


def build_monitor(cfg: Any, name: str = "trainer") -> Any:
    """The trainer's metrics sink (`metrics/<name>.jsonl` + wandb); rank 0 only."""
    from prime_async.utils.monitor import Monitor

    config = cfg.model_dump(mode="json")
    return Monitor(output_dir=cfg.output_dir, name=name, wandb_cfg=cfg.wandb, config=config)
