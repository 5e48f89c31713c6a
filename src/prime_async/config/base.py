"""Base class of every config schema.

Invariants: unknown keys are rejected (`extra="forbid"`), every field carries a description, and this
package never imports torch so that `--help` and `--dry-run` stay fast.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class BaseConfig(BaseModel):
    """Strict pydantic model: unknown keys are errors, values are validated on assignment too.

    `shorthands` maps a key the config files and flags accept to the list field it is the one-item
    spelling of (`env` -> `envs`). Only the loader knows them (`config/loader.py`): it rewrites
    `env = {...}` to `envs = [{...}]` before validation, so the schema itself has one form."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)
    shorthands: ClassVar[dict[str, str]] = {}
