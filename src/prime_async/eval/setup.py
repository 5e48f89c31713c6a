"""Building an evaluation from config: the rollout sources of the eval environments, their sampling,
their example ids; the tokenizer decode for the samples; the samples file.

Called by the orchestrator (in-run eval) and the `eval` command. Sources are built unstarted; the caller
starts and stops them (`async with`), as it does for the training sources.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prime_async.config.env import EvalEnvConfig, SamplingOverrides
from prime_async.engine_api import SamplingParams
from prime_async.eval.episodes import Decode, EvalEnv, example_ids
from prime_async.rollouts.types import RolloutSource


def merged_sampling(base: Any, *overrides: SamplingOverrides) -> SamplingParams:
    """`base` (temperature, top_p, max_tokens) with every set field of `overrides` applied in order."""
    values = {"temperature": base.temperature, "top_p": base.top_p, "max_tokens": base.max_tokens}
    for over in overrides:
        values.update({k: v for k, v in over.model_dump().items() if v is not None})
    return SamplingParams(**values)


def eval_envs(
    cfgs: Sequence[EvalEnvConfig], sources: Sequence[RolloutSource], *, base_sampling: Any,
    eval_sampling: SamplingOverrides | None = None,
) -> list[EvalEnv]:  # fmt: skip
    """`EvalEnv`s of started `sources` (one per config, same order)."""
    out = []
    for cfg, source in zip(cfgs, sources, strict=True):
        overrides = [o for o in (eval_sampling, cfg.sampling) if o is not None]
        out.append(EvalEnv(
            name=cfg.label, source=source, sampling=merged_sampling(base_sampling, *overrides),
            example_ids=example_ids(cfg.label, source.num_examples, cfg.num_examples),
            rollouts_per_example=cfg.rollouts_per_example, pass_threshold=cfg.pass_threshold,
        ))  # fmt: skip
    return out


def tokenizer_decode(model_path: str) -> Decode:
    """Token ids -> text with the model's tokenizer (special tokens kept: the chat template shows)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def write_samples(path: Path, samples: list[dict[str, Any]]) -> Path:
    """One JSON object per eval episode (env, version, example_id, rollout, reward, prompt, completion)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    return path
