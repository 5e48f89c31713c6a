"""Environment section of the orchestrator config (which verifiers environment, with what args)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from prime_async.config.base import BaseConfig


class EnvConfig(BaseConfig):
    """A verifiers (v1 Taskset) environment installed as a package, loaded by id."""

    id: str = Field("reverse-text", description="Environment id (package name; `-` and `_` are equivalent).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the environment.")
