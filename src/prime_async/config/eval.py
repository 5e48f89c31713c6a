"""Config schema of the `eval` command (`uv run eval @ eval.toml`): evaluate a model directory or a
run's published weights on environments, on an embedded engine the command starts or on SGLang URLs.

`prime_async.entrypoints.eval` parses it and calls `prime_async.launcher.eval_command.run(cfg)`.
Invariants checked at validation time: at least one environment, unique environment names, and
`weights.steps` only together with `weights.run_dir`. No torch import here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig
from prime_async.config.env import EvalEnvConfig, check_unique_names
from prime_async.config.inference import EngineConfig
from prime_async.config.shared import LogConfig, ModelConfig, WandbConfig


class EvalSamplingConfig(BaseConfig):
    """Sampling of every eval episode (each environment may override it)."""

    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    max_tokens: int = Field(128, ge=1, description="Max new tokens per model turn.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling threshold.")


class EvalWeightsConfig(BaseConfig):
    """Which weights are evaluated: the model itself, and/or versions a run published."""

    run_dir: Path | None = Field(
        None,
        description="A run's output_dir: evaluate its published versions (broadcasts/step_<n>, STABLE) "
        "instead of `model.path` (None = evaluate `model.path` only).",
    )
    steps: list[int] = Field(
        default_factory=list,
        description="Versions of `run_dir` to evaluate (empty = its newest STABLE version).",
    )
    include_base: bool = Field(
        False, description="With `run_dir`: also evaluate `model.path` (version 0) first, for comparison."
    )

    @model_validator(mode="after")
    def _check(self) -> EvalWeightsConfig:
        if self.run_dir is None and (self.steps or self.include_base):
            raise ValueError("weights.steps, weights.include_base: set weights.run_dir (a run's output_dir)")
        if any(step < 0 for step in self.steps):
            raise ValueError(f"weights.steps: versions are >= 0 (got {self.steps})")
        return self


class EvalEngineConfig(BaseConfig):
    """Where generation runs: SGLang-compatible URLs, or an embedded engine the command starts."""

    base_urls: list[str] = Field(
        default_factory=list,
        description="SGLang-compatible engines to evaluate on (they load `weights.run_dir` versions with "
        "/update_weights_from_disk, so they must see that path). Empty = start the embedded engine.",
    )
    api_key: str | None = Field(None, description="Bearer token of the engines at `base_urls`.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The embedded engine (no URLs).")
    port: int = Field(0, ge=0, le=65535, description="Port of the embedded engine on 127.0.0.1 (0 = free).")
    startup_timeout_s: float = Field(600.0, gt=0, description="How long to wait for the engine's /health.")


class EvalConfig(BaseConfig):
    """`uv run eval @ eval.toml`: metrics + a samples JSONL per evaluated version."""

    model: ModelConfig = Field(
        default_factory=ModelConfig, description="Model to evaluate (and its tokenizer, for every version)."
    )
    output_dir: Path = Field(
        Path("outputs/eval"),
        description="Where results go: metrics/eval.jsonl (step = version), eval/samples_v<version>.jsonl "
        "(as in a run), logs/ and configs/ of the embedded engine.",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb logging (metrics + samples).")
    log: LogConfig = Field(default_factory=LogConfig, description="Console logging.")
    seq_len: int = Field(2048, ge=8, description="Max tokens of one episode (prompt + completion).")
    envs: list[EvalEnvConfig] = Field(
        default_factory=lambda: [EvalEnvConfig()],
        min_length=1,
        description="Eval environments (`[[envs]]`: id, args, num_examples, rollouts_per_example, ...).",
    )
    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig, description="Sampling.")
    weights: EvalWeightsConfig = Field(default_factory=EvalWeightsConfig, description="Weights to evaluate.")
    inference: EvalEngineConfig = Field(default_factory=EvalEngineConfig, description="Engines.")
    max_concurrent_episodes: int = Field(32, ge=1, description="Eval episodes running at once.")
    wandb_table: bool = Field(True, description="Log the samples as a wandb table (when wandb is on).")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        check_unique_names(list(self.envs), "envs")
        return self
