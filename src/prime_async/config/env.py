"""Environment section of the orchestrator config (which verifiers environment, with what args, how run)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from prime_async.config.base import BaseConfig


class EnvConfig(BaseConfig):
    """A verifiers (v1 Taskset) environment installed as a package, loaded by id."""

    id: str = Field("reverse-text", description="Environment id (package name; `-` and `_` are equivalent).")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the environment's taskset config, e.g. {num_examples = 1000, seed = 0}.",
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
        default_factory=lambda: {"name": "default"},
        description="`renderers.RendererConfig` that turns chat messages into token ids client-side, e.g. "
        '{name = "default"} (the tokenizer\'s chat template) or {name = "qwen3"}.',
    )
    episode_timeout_s: float | None = Field(
        None, gt=0, description="Wall-clock limit of one episode (None = no limit); a timeout is an error."
    )
    gateway_host: str = Field("127.0.0.1", description="Address the token gateway binds (loopback).")
    gateway_port: int = Field(0, ge=0, le=65535, description="Port of the token gateway (0 = a free port).")
