"""A new package becomes a member of the uv workspace it lands in: the root pyproject.toml lists it.

    package dir ──► workspace_of(dir): the nearest pyproject.toml above with [tool.uv.workspace] whose
                    `members` globs cover the dir ──► register(pyproject, dist): `dist` appended to
                    [project].dependencies and `dist = { workspace = true }` to [tool.uv.sources]

`uv run` then locks and installs it like the repository's own environments. Invariants: `register`
edits the text in place (comments and layout kept), is idempotent, and writes nothing unless the edited
file parses as TOML with the dependency and the source present; a layout it cannot edit is a ValueError
naming the file and the lines to add by hand.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path


def workspace_of(package_dir: Path) -> Path | None:
    """The root pyproject.toml of the uv workspace `package_dir` is a member of, or None (no workspace
    above it, or its members globs do not cover it, or an `exclude` glob does)."""
    target = package_dir.resolve()
    for parent in target.parents:
        pyproject = parent / "pyproject.toml"
        if not pyproject.is_file():
            continue
        workspace = tomllib.loads(pyproject.read_text()).get("tool", {}).get("uv", {}).get("workspace")
        if workspace is None:
            continue
        rel = target.relative_to(parent).as_posix()
        covered = any(fnmatch.fnmatchcase(rel, glob) for glob in workspace.get("members", []))
        excluded = any(fnmatch.fnmatchcase(rel, glob) for glob in workspace.get("exclude", []))
        return pyproject if covered and not excluded else None
    return None


# `dependencies = [ ... ]`: strings and comments may hold a `]`
_DEPENDENCIES = re.compile(
    r"^dependencies\s*=\s*\[(?P<body>(?:\"[^\"\n]*\"|'[^'\n]*'|#[^\n]*|[^\]\"'#])*)\]", re.MULTILINE
)


def _listed(data: dict, dist: str) -> tuple[bool, bool]:
    deps = data.get("project", {}).get("dependencies", [])
    has_dep = any(re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0] == dist for d in deps)
    has_source = dist in data.get("tool", {}).get("uv", {}).get("sources", {})
    return has_dep, has_source


def _add_dependency(text: str, dist: str) -> str:
    """`dist` appended to the [project] table's `dependencies` array (one line or one entry a line)."""
    project = re.search(r"^\[project\]\s*$", text, re.MULTILINE)
    match = _DEPENDENCIES.search(text, project.end()) if project else None
    if match is None:
        raise ValueError("no `dependencies = [...]` array in [project]")
    body = match.group("body")
    if "\n" in body:  # one entry a line: a new last line, indented like the others
        indent = re.search(r"\n([ \t]+)\S", body)
        kept = body.rstrip()
        if kept.strip() and not kept.endswith((",", "[")):
            kept += ","
        new_body = f'{kept}\n{indent.group(1) if indent else "    "}"{dist}",\n'
    else:
        items = body.strip().rstrip(",")
        new_body = f'{items}, "{dist}"' if items else f'"{dist}"'
    return text[: match.start("body")] + new_body + text[match.end("body") :]


def _add_source(text: str, dist: str) -> str:
    """`dist = { workspace = true }` as the last line of [tool.uv.sources] (the table added when absent)."""
    line = f"{dist} = {{ workspace = true }}\n"
    header = re.search(r"^\[tool\.uv\.sources\]\s*$", text, re.MULTILINE)
    if header is None:
        return text.rstrip("\n") + f"\n\n[tool.uv.sources]\n{line}"
    next_table = re.compile(r"^\[", re.MULTILINE).search(text, header.end())
    end = next_table.start() if next_table else len(text)
    section = text[header.end() : end].rstrip("\n")
    return text[: header.end()] + section + "\n" + line + ("\n" if next_table else "") + text[end:]


def register(pyproject: Path, dist: str) -> bool:
    """List `dist` as a workspace dependency of `pyproject`; False when it already was."""
    text = pyproject.read_text()
    has_dep, has_source = _listed(tomllib.loads(text), dist)
    if has_dep and has_source:
        return False
    try:
        new = text if has_dep else _add_dependency(text, dist)
        new = new if has_source else _add_source(new, dist)
        if _listed(tomllib.loads(new), dist) != (True, True):
            raise ValueError("the edit did not list it")
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(
            f'new-env: could not add {dist} to {pyproject} ({e}); add it by hand: "{dist}" to '
            f"[project] dependencies and `{dist} = {{ workspace = true }}` to [tool.uv.sources]"
        ) from None
    pyproject.write_text(new)
    return True
