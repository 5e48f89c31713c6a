"""Base class of every config schema.

Invariants: unknown keys are rejected (`extra="forbid"`), every field carries a description, and this
package never imports torch so that `--help` and `--dry-run` stay fast.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class BaseConfig(BaseModel):
    """Strict pydantic model: unknown keys are errors, values are validated on assignment too.

    Two spellings of given data are rewritten before validation (`_one_form`), so the fields have one
    form: `shorthands` maps a key to the list field it is the one-item spelling of (`env = {...}` ->
    `envs = [{...}]`; both given is an error), and a union section given without its tag (`loss = {low =
    0.3}`) takes the tag of its default. The loader accepts the shorthand keys too (`config/loader.py`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)
    shorthands: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for short, target in cls.shorthands.items():
            if short in data and data.get(target):
                raise ValueError(f"{short} and {target}: give one item as `{short}` or a list as `{target}`")
            if short in data:
                data[target] = [data.pop(short)]
        for name, info in cls.model_fields.items():
            tag, value = info.discriminator, data.get(name)
            if isinstance(tag, str) and isinstance(value, dict) and tag not in value:
                default = info.get_default(call_default_factory=True, validated_data={})
                data[name] = {**value, tag: dict(default)[tag]} if isinstance(default, BaseModel) else value
        return data
