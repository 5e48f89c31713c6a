"""Config loading for every command: `cmd @ a.toml @ b.toml --optim.lr 3e-6 --no-wandb.enabled [--dry-run]`.

Later wins: defaults, files in command-line order (`--section @ f.toml` under `section`), then every flag
wherever it stands; tables deep-merge, anything else replaces. Every key is checked against the schema
before validation ("did you mean"), the file or flag that set it is kept to name it in errors, and the
schema validates once. pydantic-settings' `CliSettingsSource` parses each schema flag's value (JSON for
lists, dicts and sections, also `a,b` and `k=v`; `null` for None) and renders `--help` (every flag, type,
default); shorthands and untagged union sections are the schema's own (`BaseConfig`).

Invariants: every user error is a one-line `ConfigError` naming its file or flag (`parse_config` prints
`<prog>: error: ...`, exits 2); keys are kebab- or snake_case, free-form dict keys kept verbatim (their
values JSON where it parses); a key set twice on the command line is an error; `--flag`, `--no-flag`,
`--flag VALUE` for booleans; `--help`/`--dry-run` import only the schemas (and what `check` imports)."""

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
from prime_async.config.dicts import KeyPath, deep_merge

__all__ = ["ConfigError", "dump_toml", "load_config", "parse_config"]
T = TypeVar("T", bound=BaseModel)
NOTES = """Files merge left to right; --KEY VALUE flags win over files. Keys are dotted, kebab- or snake_case.
Booleans: --flag, --no-flag, --flag false. Lists, dicts and sections take JSON (--x.list '[1,2]').
--section @ FILE.toml merges FILE into one section. --dry-run prints the resolved TOML and exits."""


class ConfigError(ValueError):
    """A user error in config files or flags; its message is one line, printed without a traceback."""


class Flag(NamedTuple):
    """One override as typed (`flag`, its `raw` text; a bare boolean flag: True/False) for key `path`."""

    flag: str
    path: KeyPath
    raw: Any
    annotation: Any
    library: bool  # a schema field path: pydantic-settings parses its text (else JSON / text here)


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
    for data, leaves in [*files, *((_flag_data(cls, f), {f.path: f.flag}) for f in flags)]:
        merged = deep_merge(merged, data)
        provenance.update(leaves)
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
    """pydantic-settings' CLI source of `cls`: kebab-case flags, `--x`/`--no-x` booleans, `--help` text
    (every flag's type, description and default; a union tag shows its section's default variant)."""
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
    """The library gives a union's tag its last variant's default: show the section's default."""
    for name, info in cls.model_fields.items():
        tag = info.discriminator if isinstance(info.discriminator, str) else None
        default = info.get_default(call_default_factory=True, validated_data={}) if tag else None
        action = parser._option_string_actions.get(f"{prefix}{name}.{tag}".replace("_", "-"))
        if action is not None and action.help and isinstance(default, BaseModel):
            action.help = re.sub(r"\(default: [^)]*\)$", f"(default: {dict(default)[tag]})", action.help)
        for sub in _sections(info.annotation):
            _tag_defaults(sub, parser, f"{prefix}{name}.")


Layer = tuple[dict[str, Any], dict[KeyPath, str]]  # nested data, and the source of each of its leaves


def _scan(cls: type[BaseModel], argv: list[str]) -> tuple[list[Layer], list[Flag]]:
    """argv (consumed) -> the TOML files to merge as layers, in order, and the flags."""
    files: list[Layer] = []
    flags: list[Flag] = []
    while argv:
        arg = argv.pop(0)
        if arg.startswith("@"):
            files.append(_file_layer(cls, (), _file_name(arg, argv, "")))
        elif arg.startswith("--") and arg != "--dry-run":
            flags.extend(_take_flag(cls, arg, argv, files))
        elif arg != "--dry-run":
            raise ConfigError(
                f"unexpected argument '{arg}' (config files start with '@', overrides with '--')"
            )
    return files, flags


def _take_flag(cls: type[BaseModel], arg: str, argv: list[str], files: list[Layer]) -> list[Flag]:
    """`--key[=VALUE]` and the VALUE after it (consumed), or `--key @ FILE`: a layer added to `files`."""
    flag, eq, inline = arg.partition("=")
    path, annotation, direct, negated = _resolve_flag(cls, flag)
    nxt = argv[0] if argv else "--"
    if negated or _is_bool(annotation):  # a word after a boolean is its value
        if negated and eq:
            raise ConfigError(f"{flag} takes no value")
        takes = not negated and not eq and not nxt.startswith(("--", "@"))
        return [Flag(flag, path, inline if eq else argv.pop(0) if takes else not negated, annotation, False)]
    if not eq and nxt.startswith("@"):
        if not _wants_json(annotation):
            raise ConfigError(
                f"{flag}: '{'.'.join(path)}' is not a section, a TOML file cannot be merged into it"
            )
        files.append(_file_layer(cls, path, _file_name(argv.pop(0), argv, f" after {flag}")))
        return []
    if not eq and (not argv or (nxt.startswith("--") and len(nxt) > 2)):
        raise ConfigError(f"{flag} needs a value")
    return [Flag(flag, path, inline if eq else argv.pop(0), annotation, direct)]


def _file_name(arg: str, argv: list[str], owner: str) -> str:
    """The path of `@FILE`, or of `@` and the next word (consumed)."""
    if not arg[1:] and (not argv or argv[0].startswith(("-", "@"))):
        raise ConfigError(f"'@'{owner} must be followed by a TOML file path")
    return arg[1:] or argv.pop(0)


def _resolve_flag(cls: type[BaseModel], flag: str) -> tuple[KeyPath, Any, bool, bool]:
    """(path, annotation, a schema field path, negated) of `--name`; `--no-x` negates boolean `x`."""
    if flag == "--":
        raise ConfigError("empty flag '--'")
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
    if not _is_bool(annotation) and annotation is not Any:
        raise ConfigError(f"{flag}: '{'.'.join(path)}' is not a boolean")
    return path, annotation, False, True


def _flag_data(cls: type[BaseModel], item: Flag) -> dict[str, Any]:
    """One flag as nested data: pydantic-settings parses a schema field's text (JSON, `a,b` lists, `k=v`
    dicts, `null`); a free-form or shorthand key's is JSON where it parses, `null` for None, else text."""
    if item.library:
        kebab = "--" + ".".join(segment.replace("_", "-") for segment in item.path)
        try:
            return _parser(cls)(args=[f"{kebab}={item.raw}"])()
        except Exception as exc:  # the library's SettingsError or argparse error: one line, named by flag
            raise ConfigError(f"{item.flag}: {str(exc).splitlines()[0]}") from None
    value = item.raw
    nullable = item.annotation is Any or type(None) in _members(item.annotation)
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


def _is_bool(annotation: Any) -> bool:
    return {m for m in _members(annotation) if m is not type(None)} == {bool}


def _wants_json(annotation: Any) -> bool:
    """Containers, sections and free-form values take JSON on the command line (and a `@ FILE`)."""
    kinds = (list, dict, tuple, set, frozenset)
    alts = _members(annotation)
    return bool(_sections(annotation)) or any(
        m in (Any, *kinds) or typing.get_origin(m) in kinds for m in alts
    )


def _item(annotation: Any) -> Any:
    """The item annotation of a list/tuple/set annotation (Any when unknown)."""
    for m in _members(annotation):
        if typing.get_origin(m) in (list, tuple, set, frozenset):
            args = [a for a in typing.get_args(m) if a is not Ellipsis]
            return args[0] if len(args) == 1 else Any
    return Any


def _child(annotation: Any, segment: str) -> tuple[str, Any, bool] | None:
    """One key down: (its name, its annotation (Any inside a free-form dict), is a schema field), or None
    when not a key. A shorthand (`env`, `BaseConfig.shorthands`) is a key: one item of its list."""
    models = _sections(annotation)
    for name in (segment, segment.replace("-", "_")):
        for model in models:
            shorthands = model.shorthands if issubclass(model, BaseConfig) else {}
            if name in model.model_fields or name in shorthands:
                field = model.model_fields[shorthands.get(name, name)].annotation
                return name, _item(field) if name in shorthands else field, name not in shorthands
    for m in [] if models else _members(annotation):
        if m in (Any, dict) or typing.get_origin(m) is dict:
            return segment, (typing.get_args(m) or (str, Any))[-1], False
    return None


def resolve(cls: type[BaseModel], segments: list[str]) -> tuple[KeyPath, Any, bool]:
    """A dotted key against the schema: (field path, annotation, every step a field) or ConfigError."""
    path: list[str] = []
    annotation: Any = cls
    direct = True
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


def _hint(paths: list[str], bad: list[str]) -> str | None:
    """The key a misplaced `bad` most likely means: the same leaf as a key `rl` copies into the section it
    was given in, else inside that section (a key moved into a sub-section), else anywhere (shortest);
    else the closest path."""
    leaf = bad[-1].replace("-", "_")
    same = sorted((p for p in paths if p.rsplit(".", 1)[-1] == leaf), key=len)
    section = "".join(f"{s}." for s in bad[:-1])
    inside = [p[len(section) :] for p in same if section and p.startswith(section)]
    shared = [p for p in (leaf, *inside) if p in paths]  # e.g. `weights.pause_mode` for the orchestrator's
    if shared or inside or same:
        return shared[0] if shared else section + inside[0] if inside else same[0]
    close = difflib.get_close_matches(".".join(s.replace("-", "_") for s in bad), paths, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown(cls: type[BaseModel], bad: list[str]) -> str:
    """`unknown key 'a.b' (did you mean 'x.b'?)`: the same leaf elsewhere first, then the closest path."""
    hint = _hint(list(dict.fromkeys(_paths(cls))), bad)
    return f"unknown key '{'.'.join(bad)}'" + (f" (did you mean '{hint}'?)" if hint else "")


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


def _file_layer(cls: type[BaseModel], prefix: KeyPath, path: str) -> Layer:
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
    extra = first["type"] == "extra_forbidden"  # the unknown key (of a list item or a variant): as given
    for segment in first["loc"][: -1 if extra else None]:  # union tags (`mask`, `int`) dropped
        if isinstance(segment, int):
            loc[-1:], annotation = [f"{loc[-1] if loc else ''}[{segment}]"], _item(annotation)
        elif (step := _child(annotation, str(segment))) is not None:
            loc.append(step[0])
            annotation = step[1]
    loc += [str(first["loc"][-1])] if extra else []
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
