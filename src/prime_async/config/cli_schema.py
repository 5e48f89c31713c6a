"""Walk a pydantic config schema by dotted key: resolve CLI keys, suggest fixes, coerce CLI strings.

Used by `config/loader.py` only. A dotted key such as `orchestrator.max-off-policy-steps` resolves
segment by segment through nested models (unions of models: any member that has the field), then through
free-form `dict[str, X]` / `Any` values, where keys are kept verbatim.

Invariants: schema keys accept kebab-case or snake_case on the CLI and resolve to the snake_case field name;
free-form dict keys are never rewritten; an unknown key raises `ConfigError` with a "did you mean" hint.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

FREE = object()  # annotation marker: inside a free-form value, type unknown
_JSON_ORIGINS = (list, dict, tuple, set, frozenset)


class ConfigError(ValueError):
    """A user error in config files or CLI flags; its message is one line, printed without a traceback."""


def members(annotation: Any) -> list[Any]:
    """The alternatives of a (possibly Optional/Annotated) annotation, `None` included as `type(None)`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in members(arg)]
    return [annotation]


def model_members(annotation: Any) -> list[type[BaseModel]]:
    return [m for m in members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def is_bool(annotation: Any) -> bool:
    alts = [m for m in members(annotation) if m is not type(None)]
    return bool(alts) and all(m is bool for m in alts)


def allows_none(annotation: Any) -> bool:
    return annotation is FREE or any(m is type(None) or m is Any for m in members(annotation))


def wants_json(annotation: Any) -> bool:
    """True when a CLI string for this annotation should be parsed as JSON (containers, models, Any)."""
    if annotation is FREE:
        return True
    for m in members(annotation):
        if m is Any or typing.get_origin(m) in _JSON_ORIGINS or m in _JSON_ORIGINS:
            return True
        if isinstance(m, type) and issubclass(m, BaseModel):
            return True
    return False


def type_name(annotation: Any) -> str:
    """Short human name of an annotation for `--help` (`int`, `str | None`, `list[str]`, `Literal[...]`)."""
    if annotation is FREE:
        return "any"
    alts = members(annotation)
    if len(alts) > 1:
        return " | ".join(type_name(m) for m in alts)
    ann = alts[0]
    if ann is type(None):
        return "None"
    if typing.get_origin(ann) is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else str(a) for a in typing.get_args(ann))
    if typing.get_origin(ann) is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(ann))
        return f"{getattr(typing.get_origin(ann), '__name__', str(typing.get_origin(ann)))}[{args}]"
    return getattr(ann, "__name__", str(ann))


def _field_name(models: list[type[BaseModel]], segment: str) -> tuple[type[BaseModel], str] | None:
    for name in (segment, segment.replace("-", "_")):
        for model in models:
            if name in model.model_fields:
                return model, name
    return None


def _shorthand(models: list[type[BaseModel]], segment: str) -> tuple[str, Any] | None:
    """`env` of a model whose `shorthands` say it is one item of `envs`: that item's annotation."""
    for model in models:
        target = getattr(model, "shorthands", {}).get(segment.replace("-", "_"))
        if target is not None:
            return segment.replace("-", "_"), item_annotation(model.model_fields[target].annotation)
    return None


def child_annotation(annotation: Any, segment: str) -> tuple[str, Any] | None:
    """One segment down from `annotation`: (normalized segment, its annotation), or None if not a key."""
    if annotation is FREE:
        return segment, FREE
    models = model_members(annotation)
    if models:
        found = _field_name(models, segment)
        if found is None:
            return _shorthand(models, segment)
        model, name = found
        return name, model.model_fields[name].annotation
    for m in members(annotation):
        if m is Any or m is dict:
            return segment, FREE
        if typing.get_origin(m) is dict:
            args = typing.get_args(m)
            return segment, (args[1] if len(args) == 2 and args[1] is not Any else FREE)
    return None


def item_annotation(annotation: Any) -> Any:
    """Annotation of the items of a list/tuple/set annotation (FREE when unknown)."""
    for m in members(annotation):
        if typing.get_origin(m) in (list, tuple, set, frozenset):
            args = [a for a in typing.get_args(m) if a is not Ellipsis]
            return args[0] if len(args) == 1 else FREE
    return FREE


def resolve(cls: type[BaseModel], segments: list[str]) -> tuple[tuple[str, ...], Any]:
    """Normalize a dotted key against the schema; returns (path, annotation) or raises ConfigError."""
    path: list[str] = []
    annotation: Any = cls
    for segment in segments:
        if not segment:
            raise ConfigError(f"empty key segment in '{'.'.join(segments)}'")
        step = child_annotation(annotation, segment)
        if step is None:
            raise ConfigError(unknown_key_message(cls, [*path, segment], parent_annotation=annotation))
        path.append(step[0])
        annotation = step[1]
    return tuple(path), annotation


def iter_fields(cls: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Yield (dotted path, annotation, FieldInfo) for every field, depth first; union members merged."""
    for name, info in cls.model_fields.items():
        dotted = f"{prefix}{name}"
        yield dotted, info.annotation, info
        seen: set[str] = set()
        for sub in model_members(info.annotation):
            for item in iter_fields(sub, dotted + "."):
                if item[0] not in seen:
                    seen.add(item[0])
                    yield item


def suggest(cls: type[BaseModel], bad: list[str]) -> str | None:
    """Closest known dotted key to `bad`: same leaf name elsewhere first, then string similarity."""
    paths = [p for p, _, _ in iter_fields(cls)]
    leaf = bad[-1].replace("-", "_")
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return min(same_leaf, key=len)
    wanted = ".".join(s.replace("-", "_") for s in bad)
    close = difflib.get_close_matches(wanted, paths, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_message(cls: type[BaseModel], bad: list[str], *, parent_annotation: Any = None) -> str:
    key = ".".join(str(s) for s in bad)
    if parent_annotation is not None and not model_members(parent_annotation) and len(bad) > 1:
        parent = ".".join(bad[:-1])
        return f"'{parent}' is not a section (type {type_name(parent_annotation)}), it has no key '{bad[-1]}'"
    hint = suggest(cls, [str(s) for s in bad])
    return f"unknown key '{key}'" + (f" (did you mean '{hint}'?)" if hint else "")


def coerce(raw: str, annotation: Any, flag: str) -> Any:
    """CLI string -> value: JSON for containers/models, None for `null` where allowed, else the string.

    Scalars stay strings on purpose: pydantic converts "3" to int, "true" to bool, etc., and reports
    a precise error when it cannot.
    """
    if allows_none(annotation) and raw.lower() in ("null", "none"):
        return None
    if not wants_json(annotation):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        if annotation is FREE or str in members(annotation) or Any in members(annotation):
            return raw
        kind = type_name(annotation)
        raise ConfigError(f"{flag}: invalid JSON for a {kind} value: {raw!r} ({exc.msg})") from None
