"""`--help` text generated from a pydantic config schema: every field with key, type, default, description.

Used by `config/loader.py`. Sections (nested models) are listed as headers followed by their fields, and
a list of tables (`[[envs]]`) by the fields of one item (`envs[].id`), so the output doubles as a
reference of every TOML key a command accepts.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from prime_async.config.cli_schema import item_annotation, iter_fields, model_members, type_name

USAGE_NOTES = """\
Config files merge left to right; --KEY VALUE overrides win over files. Keys are dotted for nesting and
accept kebab-case or snake_case (--optim.max-norm 1.0). Booleans: --flag, --no-flag or --flag false.
Lists and dicts take JSON (--x.list '[1,2]'). --section @ FILE.toml merges FILE into one section.
--dry-run validates, prints the resolved config as TOML and exits. Bad input exits with status 2."""


def _default_text(info: Any) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return "section"
    try:
        return "= " + json.dumps(value, default=_plain)
    except (TypeError, ValueError):  # exotic defaults: show their repr rather than fail --help
        return f"= {value!r}"


def _plain(value: Any) -> Any:
    """JSON form of a default: a model as its non-default fields, anything else as text."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    return str(value)


def _describe(info: Any, indent: str) -> list[str]:
    text = (info.description or "").strip()
    if not text:
        return []
    return textwrap.wrap(text, width=108, initial_indent=indent, subsequent_indent=indent)


def render_help(cls: type[BaseModel], prog: str) -> str:
    """The full `--help` text of a command whose config schema is `cls`."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    lines = [f"usage: {prog} [@ FILE.toml ...] [--KEY VALUE ...] [--dry-run] [--help]", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += [USAGE_NOTES, "", "Fields (KEY  TYPE  DEFAULT):"]
    lines += _field_lines(cls)
    return "\n".join(lines) + "\n"


def _field_lines(cls: type[BaseModel], prefix: str = "") -> list[str]:
    lines: list[str] = []
    for dotted, annotation, info in iter_fields(cls, prefix):
        depth = dotted.count(".")
        indent = "  " + "  " * depth
        sections = model_members(annotation)
        if sections and len(sections) == len([m for m in sections if m is not type(None)]):
            variants = " | ".join(m.__name__ for m in sections)
            lines.append(f"{indent}[{dotted}]  {variants}  {_default_text(info)}")
        else:
            lines.append(f"{indent}{dotted}  {type_name(annotation)}  {_default_text(info)}")
        lines += _describe(info, indent + "    ")
        items = model_members(item_annotation(annotation))
        if len(items) == 1:  # a list of tables: the keys of one item
            lines += _field_lines(items[0], f"{dotted}[].")
    return lines
