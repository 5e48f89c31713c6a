"""Read a command line into config files and key overrides (schema-aware, nothing merged yet).

Grammar (prime-rl style):

    cmd [@ a.toml | @a.toml]... [--key.sub-key VALUE | --key=VALUE | --bool-key | --no-bool-key
        | --section @ s.toml]... [--dry-run] [--help | -h]

- `@ FILE` merges FILE at the root; `--section @ FILE` merges FILE under `section`
  (e.g. `rl --trainer @ t.toml`).
- `--key VALUE`: dotted for nesting, kebab- or snake_case; lists/dicts/sections take JSON, scalars plain text.
- Booleans: `--flag` (true), `--no-flag` (false), or `--flag true|false`.

Invariant: every malformed argument raises `ConfigError` with one line naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from prime_async.config.cli_schema import (
    FREE,
    ConfigError,
    coerce,
    is_bool,
    model_members,
    resolve,
    wants_json,
)

HELP_FLAGS = ("-h", "--help")
DRY_RUN_FLAG = "--dry-run"


@dataclass(frozen=True)
class FileArg:
    """A TOML file to merge at `prefix` (() = root)."""

    prefix: tuple[str, ...]
    path: Path


@dataclass(frozen=True)
class SetArg:
    """One override: `value` at `path`; `flag` is the argument as typed, for error messages."""

    path: tuple[str, ...]
    value: Any
    flag: str


@dataclass
class ParsedArgs:
    files: list[FileArg] = field(default_factory=list)
    sets: list[SetArg] = field(default_factory=list)
    help: bool = False
    dry_run: bool = False


def _take_file(argv: list[str], i: int, inline: str, owner: str) -> tuple[Path, int]:
    """Parse `@ FILE` / `@FILE` starting at argv[i]; returns the path and the index after it."""
    if inline:
        return Path(inline), i + 1
    if i + 1 >= len(argv) or argv[i + 1].startswith("-") or argv[i + 1].startswith("@"):
        raise ConfigError(f"'@'{owner} must be followed by a TOML file path")
    return Path(argv[i + 1]), i + 2


def _resolve_flag(cls: type[BaseModel], name: str) -> tuple[tuple[str, ...], Any, bool]:
    """(path, annotation, negated) of a flag name without its dashes; `no-x` negates boolean `x`."""
    try:
        path, annotation = resolve(cls, name.split("."))
        return path, annotation, False
    except ConfigError:
        for prefix in ("no-", "no_"):
            if name.startswith(prefix) and len(name) > len(prefix):
                try:
                    path, annotation = resolve(cls, name[len(prefix) :].split("."))
                except ConfigError:
                    break
                if not is_bool(annotation) and annotation is not FREE:
                    raise ConfigError(f"'{'.'.join(path)}' is not a boolean") from None
                return path, annotation, True
        raise


def _read_flag(cls: type[BaseModel], argv: list[str], i: int, out: ParsedArgs) -> int:
    """Consume the flag at argv[i] (and its value) into `out`; returns the next index."""
    flag, eq, inline = argv[i].partition("=")
    name = flag[2:]
    if not name:
        raise ConfigError(f"empty flag '{argv[i]}'")
    try:
        path, annotation, negated = _resolve_flag(cls, name)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    nxt = argv[i + 1] if i + 1 < len(argv) else None
    if negated:
        if eq:
            raise ConfigError(f"{flag} takes no value")
        out.sets.append(SetArg(path, False, flag))
        return i + 1
    if is_bool(annotation):
        if eq:
            out.sets.append(SetArg(path, inline, flag))
            return i + 1
        # Positional words are not part of the grammar, so a word after a boolean flag is its value
        # (`--flag maybe` is then reported as an invalid boolean, not as a stray argument).
        takes_next = nxt is not None and not nxt.startswith(("--", "@"))
        out.sets.append(SetArg(path, nxt if takes_next else True, flag))
        return i + 2 if takes_next else i + 1
    if eq:
        out.sets.append(SetArg(path, coerce(inline, annotation, flag), flag))
        return i + 1
    if nxt is not None and nxt.startswith("@"):
        if not (model_members(annotation) or (wants_json(annotation) and annotation is not FREE)):
            key = ".".join(path)
            raise ConfigError(f"{flag}: '{key}' is not a section, a TOML file cannot be merged into it")
        file_path, nxt_i = _take_file(argv, i + 1, nxt[1:], f" after {flag}")
        out.files.append(FileArg(path, file_path))
        return nxt_i
    if nxt is None or (nxt.startswith("--") and len(nxt) > 2):
        raise ConfigError(f"{flag} needs a value")
    out.sets.append(SetArg(path, coerce(nxt, annotation, flag), flag))
    return i + 2


def read_argv(cls: type[BaseModel], argv: list[str]) -> ParsedArgs:
    """Split `argv` into files to merge and overrides to apply; raises ConfigError on malformed input."""
    out = ParsedArgs()
    if any(arg in HELP_FLAGS for arg in argv):
        out.help = True
        return out
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == DRY_RUN_FLAG:
            out.dry_run = True
            i += 1
        elif arg.startswith("@"):
            path, i = _take_file(argv, i, arg[1:], "")
            out.files.append(FileArg((), path))
        elif arg.startswith("--"):
            i = _read_flag(cls, argv, i, out)
        else:
            hint = "config files start with '@', overrides with '--'"
            raise ConfigError(f"unexpected argument '{arg}' ({hint})")
    return out
