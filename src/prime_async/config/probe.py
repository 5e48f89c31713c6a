"""The `[weights.probe]` section: the check after every weight load (`weights/probe.py`, docs/weights.md).

Invariant: trainer and orchestrator read the same section (`rl` sets `[weights]` once for both): the
trainer builds the reference with `top_k` and `positions`, the orchestrator compares with the thresholds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prime_async.config.base import BaseConfig


class WeightProbeConfig(BaseConfig):
    """After each version is loaded, a fixed probe (`sequences` short token sequences of the model's own
    tokenizer) is scored on every engine and compared with the trainer's logprobs of that version.

    The thresholds are loose enough for bfloat16 on GPU (SGLang vs the trainer: sampled-token logprobs
    agree to ~5e-2, the conformance test's tolerance); a corrupted load misses them by orders of magnitude."""

    enabled: bool = Field(
        False,
        description="Run the probe after every weight load (full weights; not LoRA). Off by default: on the "
        "tiny CPU run it costs ~25-45 ms of trainer time per version (about a third of a 70 ms train step) "
        "and ~40 ms of engine time per load (docs/weights.md).",
    )
    sequences: int = Field(2, ge=1, le=8, description="Probe sequences (fixed per run).")
    tokens: int = Field(16, ge=4, le=32, description="Tokens per probe sequence.")
    positions: int = Field(
        2,
        ge=1,
        le=8,
        description="Positions per sequence (the last ones) whose whole distribution is compared.",
    )
    top_k: int = Field(
        64,
        ge=1,
        description="Tokens of each compared distribution (the trainer's top-k, plus the rest of the mass as "
        "one bucket); the vocabulary size or more compares the full vocabulary.",
    )
    max_logprob_diff: float = Field(
        0.5, gt=0, description="Largest |engine - trainer| logprob of a probe token before a mismatch."
    )
    max_kl: float = Field(0.05, gt=0, description="Largest KL(trainer || engine) at a compared position.")
    max_tv: float = Field(0.1, gt=0, le=1, description="Largest total variation at a compared position.")
    on_mismatch: Literal["warn", "stop"] = Field(
        "warn", description="warn = one ERROR line naming the version; stop = that line, then the run fails."
    )
