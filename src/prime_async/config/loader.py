"""Config loading for every command: `cmd @ a.toml @ b.toml --optim.lr 3e-6 --no-wandb.enabled [--dry-run]`.

pydantic-settings' `CliSettingsSource` parses each schema flag's value (JSON for lists, dicts and sections,
`null` for None) and renders `--help` (every flag, type, default); this module adds what it lacks: `@ FILE`
layers, key provenance, "did you mean", one-line errors. Later wins: defaults, files in command-line order
(`--section @ f.toml` under `section`, tables deep-merged), then every flag wherever it stands.

Invariants: every user error is a one-line `ConfigError` naming its file or flag (`parse_config` prints
`<prog>: error: ...`, exits 2); keys are kebab- or snake_case, checked against the schema before validation
("did you mean"), free-form dict keys kept verbatim; a key set twice on the command line is an error;
`--flag`, `--no-flag`, `--flag VALUE` for booleans; a union section without its tag keeps the default's;
`--help`/`--dry-run` import only the schemas (and what `check` imports)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from prime_async.config.base import BaseConfig
from prime_async.config.dicts import KeyPath, deep_merge, lookup

__all__ = ["ConfigError", "dump_toml", "load_config", "parse_config"]
T = TypeVar("T", bound=BaseModel)
FREE = object()  # the annotation of a value inside a free-form dict: unknown
FILE = object()  # the value of a `--section @ FILE` flag: a file layer, not a value
NOTES = """Files merge left to right; --KEY VALUE flags win over files. Keys are dotted, kebab- or snake_case.
Booleans: --flag, --no-flag, --flag false. Lists, dicts and sections take JSON (--x.list '[1,2]').
--section @ FILE.toml merges FILE into one section. --dry-run prints the resolved TOML and exits."""


class ConfigError(ValueError):
    """A user error in config files or flags; its message is one line, printed without a traceback."""


class Flag(NamedTuple):
    """One override: `raw` text (a bare boolean: True/False) for `path`; `flag` as typed."""

    flag: str
    path: KeyPath
    raw: Any
    annotation: Any
    library: bool  # a schema field path: pydantic-settings parses it (else set verbatim / as JSON here)


def parse_config(
    cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None,
    check: Callable[[T], None] | None = None, lint: Callable[[T], list[str]] | None = None,
) -> T:  # fmt: skip
    """`argv` (default sys.argv[1:]) -> `cls`; `--help`/`--dry-run` exit 0, errors exit 2 with one line.
    `check(cfg)` (what the schema cannot see) runs before `--dry-run` prints; its ValueError is one line.
    `lint(cfg)`: warning lines `--dry-run` prints after the TOML, as `WARNING ...` on stderr (stdout stays
    the TOML, loadable as is; `config/lint.py`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or Path(sys.argv[0]).name
    if any(arg in ("-h", "--help") for arg in argv):
        print(_parser(cls, prog).root_parser.format_help(), end="")
        raise SystemExit(0)
    try:
        cfg = load_config(cls, argv)
        if check is not None:
            check(cfg)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if "--dry-run" in argv:
        print(dump_toml(cfg), end="", flush=True)
        for line in lint(cfg) if lint is not None else []:
            print(f"WARNING {line}", file=sys.stderr)
        raise SystemExit(0)
    return cfg


def load_config(cls: type[T], argv: Sequence[str]) -> T:
    """Files + flags -> validated `cls`; raises `ConfigError` (one line) on any user error."""
    files, flags = _scan(cls, list(argv))
    for i, item in enumerate(flags):
        for old in flags[:i]:
            if old.path == item.path:
                raise ConfigError(f"'{'.'.join(item.path)}' is set twice on the command line: "
                                  f"{old.flag} {old.raw!r} and {item.flag} {item.raw!r}")  # fmt: skip
            if item.path[: len(old.path)] == old.path or old.path[: len(item.path)] == item.path:
                raise ConfigError(f"conflicting flags {old.flag} and {item.flag}: one sets part of the other")
    merged: dict[str, Any] = {}
    provenance: dict[KeyPath, str] = {}
    layers = [_file_layer(cls, prefix, path) for prefix, path in files]
    for data, leaves in [*layers, *((_flag_data(cls, f), {f.path: f.flag}) for f in flags)]:
        merged.update(deep_merge(merged, data))
        for path in leaves:  # a scalar or list replacing a whole table drops the table's sources
            if not isinstance(lookup(data, path)[1], dict):
                for old in [old for old in provenance if len(old) > len(path) and old[: len(path)] == path]:
                    del provenance[old]
        provenance.update(leaves)
    expand_shorthands(cls, merged)
    fill_discriminators(cls, merged)
    try:
        return cls.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(cls, exc, provenance)) from None


def dump_toml(cfg: BaseModel) -> str:
    """The resolved config as TOML (None values dropped: TOML has no null, and None is every such default)."""
    import tomli_w

    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


@functools.cache
def _parser(cls: type[BaseModel], prog: str = "") -> Any:
    """pydantic-settings' CLI source of `cls`: kebab-case flags, `--x`/`--no-x` booleans, `--help` text."""
    from pydantic_settings import CliSettingsSource

    usage = f"{prog} [@ FILE.toml ...] [--KEY VALUE ...] [--dry-run] [--help]"
    layout = functools.partial(argparse.RawDescriptionHelpFormatter, width=110, max_help_position=40)
    doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    parser = _Parser(prog=prog, usage=usage, description=doc, epilog=NOTES, formatter_class=layout)
    source = CliSettingsSource(
        cls, root_parser=parser, cli_implicit_flags=True, cli_kebab_case=True, cli_exit_on_error=False
    )
    _tag_defaults(cls, parser)
    return source


def _tag_defaults(cls: type[BaseModel], parser: argparse.ArgumentParser, prefix: str = "--") -> None:
    """The library's help gives a union's tag its last variant's default: show the section's default."""
    for name, info in cls.model_fields.items():
        tag = info.discriminator if isinstance(info.discriminator, str) else None
        default = info.get_default(call_default_factory=True, validated_data={}) if tag else None
        action = parser._option_string_actions.get(f"{prefix}{name}.{tag}".replace("_", "-"))
        if action is not None and action.help and isinstance(default, BaseModel):
            action.help = re.sub(r"\(default: [^)]*\)$", f"(default: {getattr(default, tag)})", action.help)
        for sub in _sections(info.annotation):
            _tag_defaults(sub, parser, f"{prefix}{name}.")


def _scan(cls: type[BaseModel], argv: list[str]) -> tuple[list[tuple[KeyPath, str]], list[Flag]]:
    """argv -> the TOML files to merge as (prefix, path) in order, and the flags."""
    files: list[tuple[KeyPath, str]] = []
    flags: list[Flag] = []
    i = 0
    while i < len(argv):
        arg, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        flag, eq, inline = arg.partition("=")
        if arg == "--dry-run":
            i += 1
        elif arg.startswith("@"):
            i = _take_file(argv, i, (), "", files)
        elif flag.startswith("--"):
            item = _read_flag(cls, flag, eq, inline, nxt)
            if item.raw is FILE:
                i = _take_file(argv, i + 1, item.path, f" after {flag}", files)
            else:
                flags.append(item)
                i += 1 if eq or isinstance(item.raw, bool) else 2
        else:
            raise ConfigError(
                f"unexpected argument '{arg}' (config files start with '@', overrides with '--')"
            )
    return files, flags


def _take_file(argv: list[str], i: int, prefix: KeyPath, owner: str, files: list) -> int:
    """`@ FILE` / `@FILE` at argv[i] -> `files`; returns the index after it."""
    if not argv[i][1:] and (i + 1 >= len(argv) or argv[i + 1].startswith(("-", "@"))):
        raise ConfigError(f"'@'{owner} must be followed by a TOML file path")
    files.append((prefix, argv[i][1:] or argv[i + 1]))
    return i + 1 if argv[i][1:] else i + 2


def _read_flag(cls: type[BaseModel], flag: str, eq: str, inline: str, nxt: str | None) -> Flag:
    """`--key[=VALUE]` (and the VALUE or `@ FILE` after it) -> a Flag; a word after a boolean is its value."""
    if flag == "--":
        raise ConfigError(f"empty flag '{flag}{eq}{inline}'")
    path, annotation, library, negated = _resolve_flag(cls, flag)
    if negated and eq:
        raise ConfigError(f"{flag} takes no value")
    if negated or _is_bool(annotation):
        takes = not negated and not eq and nxt is not None and not nxt.startswith(("--", "@"))
        return Flag(flag, path, inline if eq else nxt if takes else not negated, annotation, False)
    if not eq and nxt is not None and nxt.startswith("@"):
        if not (_sections(annotation) or (annotation is not FREE and _wants_json(annotation))):
            raise ConfigError(
                f"{flag}: '{'.'.join(path)}' is not a section, a TOML file cannot be merged into it"
            )
        return Flag(flag, path, FILE, annotation, False)
    if not eq and (nxt is None or (nxt.startswith("--") and len(nxt) > 2)):
        raise ConfigError(f"{flag} needs a value")
    return Flag(flag, path, inline if eq else nxt, annotation, library)


def _resolve_flag(cls: type[BaseModel], flag: str) -> tuple[KeyPath, Any, bool, bool]:
    """(path, annotation, a schema field path, negated) of `--name`; `--no-x` negates boolean `x`."""
    try:
        return (*resolve(cls, flag[2:].split(".")), False)
    except ConfigError as exc:
        error = ConfigError(f"{flag}: {exc}")
    if flag[2:5] not in ("no-", "no_"):
        raise error
    try:
        path, annotation, _ = resolve(cls, flag[5:].split("."))
    except ConfigError:
        raise error from None
    if not _is_bool(annotation) and annotation is not FREE:
        raise ConfigError(f"{flag}: '{'.'.join(path)}' is not a boolean")
    return path, annotation, False, True


def _flag_data(cls: type[BaseModel], item: Flag) -> dict[str, Any]:
    """One flag as nested data: pydantic-settings parses schema fields, the rest is set here."""
    if item.library:
        kebab = "--" + ".".join(segment.replace("_", "-") for segment in item.path)
        try:
            return _parser(cls)(args=[f"{kebab}={item.raw}"])()
        except Exception as exc:  # the library's SettingsError or argparse error: one line, named by flag
            raise ConfigError(f"{item.flag}: {str(exc).splitlines()[0]}") from None
    value = item.raw
    nullable = item.annotation is FREE or type(None) in _members(item.annotation)
    if isinstance(value, str) and value.lower() in ("null", "none") and nullable:
        value = None
    elif isinstance(value, str) and _wants_json(item.annotation):
        with contextlib.suppress(json.JSONDecodeError):  # a plain word stays a string
            value = json.loads(value)
    return _nest(item.path, value)


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a (possibly Optional/Annotated) annotation, `None` as `type(None)`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _sections(annotation: Any) -> list[type[BaseModel]]:
    return [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def _shorthands(model: type[BaseModel]) -> dict[str, str]:
    return model.shorthands if issubclass(model, BaseConfig) else {}


def _is_bool(annotation: Any) -> bool:
    return {m for m in _members(annotation) if m is not type(None)} == {bool}


def _wants_json(annotation: Any) -> bool:
    """Containers, sections and free-form values take JSON on the command line."""
    kinds = (list, dict, tuple, set, frozenset)
    alts = _members(annotation)
    return bool(_sections(annotation)) or any(
        m in (FREE, Any, *kinds) or typing.get_origin(m) in kinds for m in alts
    )


def _item(annotation: Any) -> Any:
    """The item annotation of a list/tuple/set annotation (FREE when unknown)."""
    for m in _members(annotation):
        if typing.get_origin(m) in (list, tuple, set, frozenset):
            args = [a for a in typing.get_args(m) if a is not Ellipsis]
            return args[0] if len(args) == 1 else FREE
    return FREE


def _child(annotation: Any, segment: str) -> tuple[str, Any, bool] | None:
    """One key down: (its field name, its annotation, is a schema field), or None when not a key."""
    models = _sections(annotation)
    for name in (segment, segment.replace("-", "_")):
        for model in models:
            if name in model.model_fields:
                return name, model.model_fields[name].annotation, True
            if name in _shorthands(model):  # `env`, one item of `envs`
                return name, _item(model.model_fields[_shorthands(model)[name]].annotation), False
    for m in [] if models else _members(annotation):
        if m in (FREE, Any, dict) or typing.get_origin(m) is dict:
            value = typing.get_args(m)[1] if len(typing.get_args(m)) == 2 else Any
            return segment, FREE if value is Any else value, False
    return None


def resolve(cls: type[BaseModel], segments: list[str]) -> tuple[KeyPath, Any, bool]:
    """A dotted key against the schema: (field path, annotation, every step a field) or ConfigError."""
    path: list[str] = []
    annotation, direct = cls, True
    for segment in segments:
        if not segment:
            raise ConfigError(f"empty key segment in '{'.'.join(segments)}'")
        step = _child(annotation, segment)
        if step is None and path and not _sections(annotation):
            kind = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
            raise ConfigError(f"'{'.'.join(path)}' is not a section (type {kind}), it has no key '{segment}'")
        if step is None:
            raise ConfigError(_unknown(cls, [*path, segment]))
        path.append(step[0])
        annotation, direct = step[1], direct and step[2]
    return tuple(path), annotation, direct


def _paths(cls: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, info in cls.model_fields.items():
        yield prefix + name
        for sub in _sections(info.annotation):
            yield from _paths(sub, f"{prefix}{name}.")


def _unknown(cls: type[BaseModel], bad: list[str]) -> str:
    """`unknown key 'a.b' (did you mean 'x.b'?)`: the same leaf elsewhere first, then the closest path."""
    paths = list(dict.fromkeys(_paths(cls)))
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == bad[-1].replace("-", "_")]
    close = difflib.get_close_matches(".".join(s.replace("-", "_") for s in bad), paths, n=1, cutoff=0.6)
    hint = min(same_leaf, key=len) if same_leaf else close[0] if close else None
    return f"unknown key '{'.'.join(bad)}'" + (f" (did you mean '{hint}'?)" if hint else "")


def expand_shorthands(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """Each shorthand key (`env`) becomes its list (`envs = [env]`), in every section; both is an error."""
    for short, target in _shorthands(cls).items():
        if short in data and data.get(target):
            raise ConfigError(f"{short} and {target}: give one item as `{short}` or a list as `{target}`")
        if short in data:
            data[target] = [data.pop(short)]
    for name, info in cls.model_fields.items():
        value = data.get(name)
        for sub in _sections(info.annotation) if isinstance(value, dict) else []:
            if all(key in sub.model_fields or key in _shorthands(sub) for key in value):
                expand_shorthands(sub, value)
                break


def fill_discriminators(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """A partial union section without its tag (`--loss.low 0.3`) gets the default variant's tag."""
    for name, info in cls.model_fields.items():
        value, variants = data.get(name), _sections(info.annotation)
        if not isinstance(value, dict) or not variants:
            continue
        tag = info.discriminator if isinstance(info.discriminator, str) else None
        default = info.get_default(call_default_factory=True, validated_data={}) if tag else None
        if tag and tag not in value and isinstance(default, BaseModel) and tag in type(default).model_fields:
            value[tag] = getattr(default, tag)
        chosen = [v for v in variants if all(key in v.model_fields for key in value)]
        chosen = [v for v in chosen if not tag or _tag_default(v, tag) == value.get(tag)]
        if chosen:
            fill_discriminators(chosen[0], value)


def _tag_default(variant: type[BaseModel], tag: str) -> Any:
    return variant.model_fields[tag].default if tag in variant.model_fields else None


def read_toml(path: str) -> dict[str, Any]:
    """Parse one TOML file; a missing file or a syntax error becomes a one-line `ConfigError`."""
    if not Path(path).is_file():
        raise ConfigError(
            f"config {'path is not a file' if Path(path).exists() else 'file not found'}: {path}"
        )
    try:
        with Path(path).open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:  # tomllib says "Cannot overwrite a value" for a key set twice
        hint = "duplicate key: " * ("Cannot overwrite" in str(exc))
        raise ConfigError(f"{path}: TOML syntax error: {hint}{exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None


def _file_layer(cls: type[BaseModel], prefix: KeyPath, path: str) -> tuple[dict, dict[KeyPath, str]]:
    """One TOML file nested under `prefix`, and the file as the source of each of its leaves."""
    leaves: dict[KeyPath, str] = {}
    return _nest(prefix, _normalize(cls, read_toml(path), prefix, path, leaves)), leaves


def _normalize(cls: type[BaseModel], table: dict, prefix: KeyPath, source: str, leaves: dict) -> dict:
    """A file's keys as field names (checked against the schema), recording each leaf's `source`."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        try:
            path, annotation, _ = resolve(cls, [*prefix, key])
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        if path[-1] in out:
            raise ConfigError(f"{source}: key '{'.'.join(path)}' appears twice (as '{key}' and '{path[-1]}')")
        nested = isinstance(value, dict) and _sections(annotation)
        out[path[-1]] = _normalize(cls, value, path, source, leaves) if nested else value
        leaves.update({} if nested else {path: source})
    return out


def _nest(path: KeyPath, value: Any) -> Any:
    for segment in reversed(path):
        value = {segment: value}
    return value


def format_validation_error(cls: type[BaseModel], exc: ValidationError, provenance: dict) -> str:
    """The first pydantic error as `<source>: <dotted.key>: <reason> (got <value>)` (+ count of others)."""
    errors = exc.errors(include_url=False)
    first, loc, annotation = errors[0], [], cls
    for segment in first["loc"]:  # as config keys: union tags (`mask`, `int`) dropped, list indexes kept
        if isinstance(segment, int):
            loc[-1:], annotation = [f"{loc[-1] if loc else ''}[{segment}]"], _item(annotation)
        elif (step := _child(annotation, str(segment))) is not None:
            loc.append(step[0])
            annotation = step[1]
    if first["type"] == "extra_forbidden":  # a key of a list item: not in the schema, so named here
        loc.append(str(first["loc"][-1]))
    plain = tuple(segment.split("[")[0] for segment in loc)
    sources = [provenance[plain[:end]] for end in range(len(plain), 0, -1) if plain[:end] in provenance]
    below = {source for path, source in provenance.items() if path[: len(plain)] == plain}
    source = sources[0] if sources else below.pop() if len(below) == 1 else ""
    named = source.startswith("--") and provenance.get(tuple(loc)) == source  # a flag names its key
    text = ": ".join([p for p in (source, "" if named else ".".join(loc)) if p] + [_reason(first)])
    return text + (f" (and {len(errors) - 1} more error{'s' * (len(errors) > 2)})" if len(errors) > 1 else "")


def _reason(error: dict[str, Any]) -> str:
    message, value = str(error["msg"]), error.get("input")
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    if error["type"] in ("missing", "extra_forbidden"):
        return "required value is missing" if error["type"] == "missing" else "unknown key"
    if value is None or isinstance(value, str | int | float | bool):
        return f"{message} (got {repr(value)[:80]}{'...' * (len(repr(value)) > 80)})"
    return message
