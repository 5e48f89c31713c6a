"""Command-line config loading for every command: `cmd @ a.toml @ b.toml --optim.lr 3e-6 --no-wandb.enabled`.

Called by `prime_async.entrypoints.*` through `parse_config(cls, argv)`; tests may call `load_config` to
get the `ConfigError` instead of an exit. The grammar lives in `cli_args.py`, schema walking in
`cli_schema.py`, the `--help` text in `cli_help.py`.

    argv ─read_argv─► files + flags ─merge (files in order, then flags)─► raw dict
         ─fill union tags─► pydantic model_validate (extra="forbid") ─► config  | one-line ConfigError

Resolution order (later wins): the schema's defaults, then every TOML file in the order it appears on the
command line (`@ file.toml` at the root, `--section @ file.toml` nested under `section`), deep-merged table
by table, then the value flags. Relative paths inside files are kept as written (relative to the working
directory).

Invariants:
- every user error is a `ConfigError` whose message is one line naming the file and/or the key and the
  reason; `parse_config` prints it as `<prog>: error: <message>` and exits 2, never with a traceback;
- file keys are checked against the schema before validation (kebab-case or snake_case, "did you mean"),
  so an unknown key is reported with the file that introduced it;
- one key set twice on the command line is an error (files, by contrast, override each other by design);
- a union section given without its tag (`--loss.low 0.3`) keeps the default variant's tag;
- `--help` exits 0 and imports nothing but the config schemas; `--dry-run` too, besides what the
  command's `check` imports (`rl`: every environment, to validate it before anything starts).
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from prime_async.config.cli_args import ParsedArgs, SetArg, read_argv
from prime_async.config.cli_schema import (
    ConfigError,
    child_annotation,
    item_annotation,
    model_members,
    resolve,
)
from prime_async.config.dicts import KeyPath, deep_merge, lookup

__all__ = ["ConfigError", "dump_toml", "load_config", "parse_config"]

T = TypeVar("T", bound=BaseModel)

EXIT_USAGE = 2


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    check: Callable[[T], None] | None = None,
) -> T:
    """Parse `argv` (default: sys.argv[1:]) into `cls`; handles `--help` / `--dry-run`, exits 2 on errors.
    `check(cfg)` runs on the validated config before `--dry-run` prints it (a command's checks of what
    the schema cannot see, e.g. `rl` imports every environment): its ValueError is one error line too."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or Path(sys.argv[0]).name
    try:
        parsed = read_argv(cls, argv)
        if parsed.help:
            from prime_async.config.cli_help import render_help

            print(render_help(cls, prog), end="")
            raise SystemExit(0)
        cfg = build_config(cls, parsed)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if check is not None:
        try:
            check(cfg)
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
    if parsed.dry_run:
        print(dump_toml(cfg), end="")
        raise SystemExit(0)
    return cfg


def load_config(cls: type[T], argv: Sequence[str]) -> T:
    """Files + flags -> validated `cls`; raises `ConfigError` (one line) on any user error."""
    return build_config(cls, read_argv(cls, list(argv)))


def build_config(cls: type[T], parsed: ParsedArgs) -> T:
    """Merge the files of `parsed` left to right, apply its overrides, validate."""
    _check_duplicate_sets(parsed.sets)
    merged: dict[str, Any] = {}
    provenance: dict[KeyPath, str] = {}
    for file_arg in parsed.files:
        data, leaves = file_layer(cls, str(file_arg.path), prefix=file_arg.prefix)
        _apply(merged, provenance, data, leaves)
    for item in parsed.sets:
        _apply(merged, provenance, _nest(item.path, item.value), {item.path: item.flag})
    expand_shorthands(cls, merged)
    fill_discriminators(cls, merged)
    try:
        return cls.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(cls, exc, provenance)) from None


def expand_shorthands(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """Rewrite each shorthand key (`BaseConfig.shorthands`, e.g. `env`) to its list (`envs = [env]`), in
    every section of `data`; giving both spellings is an error naming both."""
    for short, target in getattr(cls, "shorthands", {}).items():
        if short not in data:
            continue
        if data.get(target):
            raise ConfigError(f"{short} and {target}: give one item as `{short}` or a list as `{target}`")
        data[target] = [data.pop(short)]
    for name, info in cls.model_fields.items():
        value = data.get(name)
        for sub in model_members(info.annotation) if isinstance(value, dict) else []:
            if all(key in sub.model_fields or key in getattr(sub, "shorthands", {}) for key in value):
                expand_shorthands(sub, value)
                break


def fill_discriminators(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """A partial union section without its tag (`--loss.low 0.3`) gets the default variant's tag."""
    for name, info in cls.model_fields.items():
        value = data.get(name)
        variants = model_members(info.annotation)
        if not isinstance(value, dict) or not variants:
            continue
        tag_key = info.discriminator if isinstance(info.discriminator, str) else None
        if tag_key is not None and tag_key not in value:
            default = info.get_default(call_default_factory=True, validated_data={})
            if isinstance(default, BaseModel) and getattr(default, tag_key, None) is not None:
                value[tag_key] = getattr(default, tag_key)
        chosen = [v for v in variants if tag_key is None or _tag_of(v, tag_key) == value.get(tag_key)]
        chosen = [v for v in chosen if all(key in v.model_fields for key in value)]
        if chosen:
            fill_discriminators(chosen[0], value)


def _tag_of(variant: type[BaseModel], tag_key: str) -> Any:
    info = variant.model_fields.get(tag_key)
    return None if info is None else info.default


def dump_toml(cfg: BaseModel) -> str:
    """The resolved config as TOML (None values dropped: TOML has no null, and None is every such default)."""
    import tomli_w

    return tomli_w.dumps(drop_none(cfg.model_dump(mode="json")))


def drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------ merging


def _check_duplicate_sets(sets: list[SetArg]) -> None:
    for i, item in enumerate(sets):
        for earlier in sets[:i]:
            if earlier.path == item.path:
                raise ConfigError(
                    f"'{'.'.join(item.path)}' is set twice on the command line: "
                    f"{earlier.flag} {earlier.value!r} and {item.flag} {item.value!r}"
                )
            shorter = min(len(earlier.path), len(item.path))
            if earlier.path[:shorter] == item.path[:shorter]:
                raise ConfigError(
                    f"conflicting flags {earlier.flag} and {item.flag}: one sets part of the other"
                )


def _nest(path: KeyPath, value: Any) -> dict[str, Any]:
    for segment in reversed(path):
        value = {segment: value}
    return value


def _apply(
    merged: dict[str, Any], provenance: dict[KeyPath, str], data: dict[str, Any], leaves: dict[KeyPath, str]
) -> None:
    merged.update(deep_merge(merged, data))
    for path in leaves:
        _, value = lookup(data, path)
        if isinstance(value, dict):
            continue  # a table merges into what is there: the sources below it stay valid
        for old in [old for old in provenance if len(old) > len(path) and old[: len(path)] == path]:
            del provenance[old]  # a scalar or list replaced the whole subtree
    provenance.update(leaves)


# -------------------------------------------------------------------------------------------- files


def read_toml(path: str) -> dict[str, Any]:
    """Parse one TOML file; a missing file or a syntax error becomes a one-line `ConfigError`."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"config file not found: {path}")
    if not file.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    try:
        with file.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        # tomllib says "Cannot overwrite a value" for a key defined twice in one file.
        hint = "duplicate key: " if "Cannot overwrite" in str(exc) else ""
        raise ConfigError(f"{path}: TOML syntax error: {hint}{exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None


def file_layer(
    cls: type[BaseModel], path: str, *, prefix: KeyPath
) -> tuple[dict[str, Any], dict[KeyPath, str]]:
    """Read `path`, check its keys against the schema under `prefix`, nest it there; (data, leaf sources)."""
    leaves: dict[KeyPath, str] = {}
    data = _normalize(cls, read_toml(path), prefix=prefix, source=path, leaves=leaves)
    return _nest(prefix, data) if prefix else data, leaves


def _normalize(
    cls: type[BaseModel], table: dict[str, Any], *, prefix: KeyPath, source: str, leaves: dict[KeyPath, str]
) -> dict[str, Any]:
    """Rewrite kebab-case keys to field names (recursively), recording which leaf came from `source`."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        try:
            path, annotation = resolve(cls, [*prefix, key])
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        name = path[-1]
        if name in out:
            raise ConfigError(f"{source}: key '{'.'.join(path)}' appears twice (as '{key}' and '{name}')")
        if isinstance(value, dict) and model_members(annotation):
            out[name] = _normalize(cls, value, prefix=path, source=source, leaves=leaves)
        else:
            out[name] = value
            leaves[path] = source
    return out


# ------------------------------------------------------------------------------------------- errors


def format_validation_error(
    cls: type[BaseModel], exc: ValidationError, provenance: dict[KeyPath, str]
) -> str:
    """The first pydantic error as `<source>: <dotted.key>: <reason> (got <value>)` (+ count of others)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = schema_loc(cls, first["loc"])
    if first["type"] == "extra_forbidden":  # e.g. a key of a list item: not in the schema, so named here
        loc = (*loc, str(first["loc"][-1]))
    source = _source_of(loc, provenance)
    # A flag already names its key (`--optim.lr: ...`); a file does not.
    key = "" if source.startswith("--") and provenance.get(loc) == source else ".".join(loc)
    parts = [p for p in (source, key) if p]
    text = ": ".join([*parts, _reason(first)])
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text


def schema_loc(cls: type[BaseModel], loc: tuple[Any, ...]) -> KeyPath:
    """A pydantic error location as config keys: union tags (`mask`, `int`) dropped, list indexes kept."""
    out: list[str] = []
    annotation: Any = cls
    for segment in loc:
        if isinstance(segment, int):
            out[-1:] = [f"{out[-1]}[{segment}]"] if out else [f"[{segment}]"]
            annotation = item_annotation(annotation)
            continue
        step = child_annotation(annotation, str(segment))
        if step is not None:
            out.append(step[0])
            annotation = step[1]
        # else: a union tag such as 'mask', 'int' or 'function-after[...]': not a config key
    return tuple(out)


def _reason(error: dict[str, Any]) -> str:
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    if error["type"] == "missing":
        return "required value is missing"
    if error["type"] == "extra_forbidden":
        return "unknown key"
    value = error.get("input")
    if value is None or isinstance(value, str | int | float | bool):
        shown = repr(value)
        return f"{message} (got {shown[:80]}{'...' if len(shown) > 80 else ''})"
    return message


def _source_of(loc: KeyPath, provenance: dict[KeyPath, str]) -> str:
    """Which file/flag set the value at `loc` (or the single source of everything below it)."""
    plain = tuple(segment.split("[")[0] for segment in loc)
    for end in range(len(plain), 0, -1):
        if plain[:end] in provenance:
            return provenance[plain[:end]]
    below = {source for path, source in provenance.items() if path[: len(plain)] == plain}
    return below.pop() if len(below) == 1 else ""
