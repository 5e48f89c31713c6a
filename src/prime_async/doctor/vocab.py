"""Engine vs trainer over the full vocabulary at version 0: the weight probe (`weights/probe.py`) once.

    diagnose: engine up ──engine_answer(url)──► the probe's sequences scored with every token's logprob
              engine down ──vocab_check(cfg, answer)──► the trainer model's reference, compare ──► a row

The probe is the run's (`weights.probe`: sequences, tokens, positions, thresholds) with `top_k` = the
vocabulary, so KL and total variation are over the full distribution at each compared position.
"""

from __future__ import annotations

from dataclasses import dataclass

from prime_async.config.rl import RLConfig
from prime_async.doctor.checks import CheckResult
from prime_async.weights.probe import ProbeFigures

NAME = "engine vs trainer full vocabulary (v0)"


@dataclass(frozen=True)
class EngineAnswer:
    """The engine's answer to the probe: sampled-token logprobs and the full-vocabulary tops."""

    sequences: list[list[int]]
    logprobs: list[list[float]]
    tops: list[list[dict[int, float]]]


async def engine_answer(cfg: RLConfig, url: str) -> EngineAnswer:
    """Score the probe on the engine at `url` with every token's logprob (`top_logprobs_num` = vocab)."""
    from transformers import AutoConfig

    from prime_async.inference.client import HttpEngineClient
    from prime_async.trainer.probe_reference import ProbeBuilder

    vocab = AutoConfig.from_pretrained(cfg.model.path).get_text_config().vocab_size  # a VLM's: its text's
    sequences = ProbeBuilder.from_model_path(cfg.trainer.weights.probe, cfg.model.path).sequences
    client = HttpEngineClient(url, cfg.orchestrator.inference.api_key)
    answers = await client.score_top(sequences, [1] * len(sequences), vocab)
    return EngineAnswer(sequences, [lps for lps, _ in answers], [tops for _, tops in answers])


def vocab_figures(cfg: RLConfig, answer: EngineAnswer) -> ProbeFigures:
    """The trainer model's reference of the probe (the fsdp backend's load, dtype included), compared."""
    import torch

    from prime_async.trainer.fsdp import load_model
    from prime_async.trainer.probe_reference import ProbeBuilder, probe_logits
    from prime_async.weights.probe import compare
    from prime_async.weights.probe_check import tops_at

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(cfg.trainer, device).eval()
    probe = cfg.trainer.weights.probe.model_copy(update={"top_k": model.config.get_text_config().vocab_size})
    ref = ProbeBuilder(probe, answer.sequences).reference(probe_logits(model, answer.sequences))
    return compare(ref, answer.logprobs, tops_at(ref, answer.tops))


def vocab_check(cfg: RLConfig, answer: EngineAnswer | None) -> CheckResult:
    """The row: passed when every figure is within `weights.probe`'s thresholds."""
    if answer is None:
        return CheckResult(NAME, None, "not run (LoRA: the engine scores the base model)")
    limits = cfg.trainer.weights.probe
    f = vocab_figures(cfg, answer)
    detail = (
        f"max |logprob diff| {f.max_abs_logprob_diff:.2e}, KL {f.kl:.2e}, TV {f.tv:.2e} over "
        f"{len(answer.sequences)} probe sequences (limits {limits.max_logprob_diff}, {limits.max_kl}, "
        f"{limits.max_tv})"
    )
    if f.max_abs_logprob_diff <= limits.max_logprob_diff and f.kl <= limits.max_kl and f.tv <= limits.max_tv:
        return CheckResult(NAME, True, detail)
    return CheckResult(
        NAME, False, detail,
        "the engine computes another distribution than the trainer: same model.dtype, attention and RoPE "
        "settings on both sides; a tied or untied LM head read alike (docs/weights.md, weight probe)",
    )  # fmt: skip
