"""Environment sections of the orchestrator and eval configs: which verifiers environment, with what args,
how it is run, and (for a mix) its name, ratio and sampling overrides.

`EnvBaseConfig` is what the rollout source needs to load and run an environment
(`rollouts/verifiers_source.py`); `EnvConfig` is one training environment of `orchestrator.envs`
(`[orchestrator.env]` is the one-environment spelling); `EvalEnvConfig` is one environment of
`orchestrator.eval.envs` and of the `eval` command.

Invariants: `name` is never empty after validation (it defaults to `id`) and is usable as a metric path
segment (letters, digits, `-`, `_`, `.`); a training environment never overrides the sampling temperature
(the trainer recomputes logprobs at `orchestrator.sampling.temperature` for a whole batch).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from prime_async.config.base import BaseConfig

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESERVED_NAMES = frozenset({"mean", "std", "seat", "episodes", "errors"})


class SamplingOverrides(BaseConfig):
    """Per-environment sampling settings; each unset field keeps `orchestrator.sampling`'s."""

    temperature: float | None = Field(
        None, ge=0, description="Sampling temperature (eval environments only; 0 = greedy)."
    )
    max_tokens: int | None = Field(None, ge=1, description="Max new tokens per model turn.")
    top_p: float | None = Field(None, gt=0, le=1.0, description="Nucleus sampling threshold.")


class EnvBaseConfig(BaseConfig):
    """A verifiers (v1 Taskset) environment installed as a package, loaded by id."""

    id: str = Field("reverse-text", description="Environment id (package name; `-` and `_` are equivalent).")
    name: str | None = Field(
        None,
        description="Name in metrics (`reward/<name>/mean`, `eval/<name>/...`) and checkpoints; "
        "None = the id. Must be unique within its list.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the environment's taskset config, e.g. {num_examples = 1000, seed = 0}.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the environment's own verifiers `EnvConfig`, deep-merged over the runner's "
        "defaults: env-level fields (e.g. {max_concurrent_agents = 2}), a seat by its field name "
        "(e.g. {agent = {max_turns = 4}} or, for a two-seat env, {white = {...}, black = {...}}), or "
        '{id = "best-of-n"} to pair a verifiers env with the taskset. Each seat is filled with the '
        "runner's harness and the subprocess runtime unless it pins its own.",
    )
    runner: Literal["inprocess", "subprocess", "env_server"] = Field(
        "inprocess",
        description="How verifiers runs each episode's harness: `inprocess` = an in-process chat harness "
        "(no subprocess, no network; the default); `subprocess` = verifiers' `null` harness "
        "program in the subprocess runtime (first use bootstraps it with `uv sync --script`, which "
        "needs the package index or a warm uv cache); `env_server` = verifiers' env server in a spawned "
        "process (what prime-rl runs) with the `null` harness program, reached over ZeroMQ.",
    )
    renderer: dict[str, Any] = Field(
        default_factory=lambda: {"name": "auto"},
        description="`renderers.RendererConfig` that turns chat messages into token ids client-side: "
        '{name = "auto"} (chosen from the model: Qwen3 -> qwen3 ..., else the tokenizer\'s chat template), '
        '{name = "default"} (the tokenizer\'s chat template) or e.g. {name = "qwen3"}. Every turn\'s prompt '
        "extends the previous turn's tokens as sampled (token in, token out: rollouts/token_bridge.py); "
        "`token_exact = false` in this table renders every turn afresh from the chat's text instead.",
    )
    toolsets: Literal["inprocess", "verifiers"] = Field(
        "inprocess",
        description="Where the `inprocess` runner serves a task's Python toolsets (`vf.Toolset` classes): "
        "`inprocess` = inside the orchestrator, no process per episode; `verifiers` = verifiers' own way "
        "(a tool-server subprocess per episode). Toolsets by URL or in a sandbox always go verifiers' way.",
    )
    episode_timeout_s: float | None = Field(
        None, gt=0, description="Wall-clock limit of one episode (None = no limit); a timeout is an error."
    )
    gateway_host: str = Field("127.0.0.1", description="Address the token gateway binds (loopback).")
    gateway_port: int = Field(0, ge=0, le=65535, description="Port of the token gateway (0 = a free port).")

    @property
    def label(self) -> str:
        """The metric/checkpoint name: `name`, or the id."""
        return self.name or self.id

    @model_validator(mode="after")
    def _check_name(self) -> EnvBaseConfig:
        if not _NAME.match(self.label) or self.label in RESERVED_NAMES:
            raise ValueError(
                f"name {self.label!r}: an environment name must start with a letter or digit, hold only "
                f"letters, digits, '-', '_', '.', and not be one of {sorted(RESERVED_NAMES)} (set `name`)"
            )
        return self


class EnvConfig(EnvBaseConfig):
    """One training environment: its share of the groups and its sampling overrides."""

    ratio: float = Field(
        1.0,
        gt=0,
        description="Share of the groups (trained or in progress; a group dropped untrained gives its "
        "slot back), relative to the other environments' ratios (3 and 1: three groups of this env for "
        "one of the other).",
    )
    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides,
        description="Overrides of `orchestrator.sampling` for this environment (max_tokens, top_p; the "
        "temperature is the run's).",
    )

    @model_validator(mode="after")
    def _no_temperature(self) -> EnvConfig:
        if self.sampling.temperature is not None:
            raise ValueError(
                "sampling.temperature: a training environment keeps orchestrator.sampling.temperature (the "
                "trainer recomputes logprobs at one temperature per batch); override max_tokens or top_p"
            )
        return self


class EvalEnvConfig(EnvBaseConfig):
    """One evaluation environment: which examples, how many rollouts each, how sampled."""

    num_examples: int | None = Field(
        None,
        ge=1,
        description="Evaluate the first this many tasks of the taskset, in its order (None = all of a "
        "finite taskset; an infinite one needs a number).",
    )
    rollouts_per_example: int = Field(
        1, ge=1, description="k: episodes per example (`reward/mean` is avg@k, `pass@k` below)."
    )
    pass_threshold: float = Field(
        1.0, description="An episode passes when its reward is at least this (for `pass@k`)."
    )
    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides,
        description="Overrides of the eval sampling (`temperature`, `max_tokens`, `top_p`).",
    )


def check_unique_names(envs: list[EnvBaseConfig], key: str) -> None:
    """ValueError naming `key` when two environments of one list share a name."""
    seen: set[str] = set()
    for i, env in enumerate(envs):
        if env.label in seen:
            raise ValueError(
                f"{key}[{i}].name: {env.label!r} is used twice; give each environment its own `name`"
            )
        seen.add(env.label)
