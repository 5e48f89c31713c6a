"""Synthetic training batches and a transport config on free ports (tests, `scripts/bench_transport.py`)."""

from __future__ import annotations

import numpy as np

from prime_async.config.shared import TransportConfig
from prime_async.launcher.identity import free_ports
from prime_async.transport.types import MicroBatch, TrainBatch


def transport_cfg(**kw) -> TransportConfig:
    port = free_ports("127.0.0.1", 2)  # the batch channel and the control channel next to it
    return TransportConfig(host="127.0.0.1", port=port, timeout_s=kw.pop("timeout_s", 10.0), **kw)


def make_micro_batch(
    rng: np.random.Generator, sample_lens: list[int], *, vocab: int = 1000, prompt_len: int = 3
) -> MicroBatch:
    """Packed row of samples: the first `prompt_len` tokens of each sample are prompt (not in the loss)."""
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in sample_lens])
    mask = pos >= prompt_len
    adv = np.concatenate([np.full(n, rng.normal(), dtype=np.float32) for n in sample_lens])
    return MicroBatch(
        input_ids=rng.integers(0, vocab, size=pos.shape[0], dtype=np.int32),
        position_ids=pos,
        loss_mask=mask,
        advantages=np.where(mask, adv, 0).astype(np.float32),
        sampler_logprobs=np.where(mask, -rng.uniform(0.5, 5, pos.shape[0]), 0).astype(np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
    )


def make_batch(
    step: int, layout: list[list[list[int]]], *, seed: int = 0, vocab: int = 1000, temperature: float = 1.0
) -> TrainBatch:
    """`layout[rank][micro_batch]` = list of sample lengths packed into that micro-batch."""
    rng = np.random.default_rng(seed * 1000 + step)
    mbs = [[make_micro_batch(rng, lens, vocab=vocab) for lens in rank] for rank in layout]
    return TrainBatch(
        step=step,
        micro_batches=mbs,
        num_loss_tokens=sum(mb.num_loss_tokens for rank in mbs for mb in rank),
        temperature=temperature,
        min_dispatch_version=max(0, step - 1),
        metrics={"reward/mean": 0.5},
    )
