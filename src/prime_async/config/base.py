"""Base class of every config schema.

Invariants: unknown keys are rejected (`extra="forbid"`), every field carries a description, and this
package never imports torch so that `--help` and `--dry-run` stay fast.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class BaseConfig(BaseModel):
    """Strict pydantic model: unknown keys are errors, values are validated on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)
