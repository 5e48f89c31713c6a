"""`uv run new-env NAME [--multi-turn | --tools | --seats N] [--dir DIR]`: write an environment package.

Writes `DIR/<package>/` (default DIR: `environments`): pyproject.toml, README.md, the package (taskset,
task, reward, metric, env), `rl_tiny.toml` and a test (`prime_async.scaffold`). Inside a uv workspace
whose members cover it (this repository: `environments/*`), the root pyproject.toml lists it, so the next
`uv run` installs it; elsewhere the printed next steps start with `uv pip install -e`. Exits 2 with one
line for a bad name, an existing directory or a name an installed package already takes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from prime_async.scaffold.render import MAX_SEATS, Kind, names, render
from prime_async.scaffold.workspace import register, workspace_of


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="new-env", description="Write a verifiers v1 environment package that trains as written."
    )
    parser.add_argument("name", help="the environment id, e.g. guess-number (package guess_number)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--multi-turn", action="store_true", help="the env answers between the model's turns")
    kind.add_argument("--tools", action="store_true", help="the model calls a tool (an MCP vf.Toolset)")
    kind.add_argument("--seats", type=int, metavar="N", help=f"N agents (2-{MAX_SEATS}) take turns")
    parser.add_argument("--dir", type=Path, default=Path("environments"), help="parent directory")
    parser.add_argument(
        "--no-register", action="store_true", help="do not list it in the workspace's pyproject.toml"
    )
    return parser


def _kind(args: argparse.Namespace) -> Kind:
    if args.seats is not None:
        return "seats"
    return "multi_turn" if args.multi_turn else "tools" if args.tools else "single_turn"


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it, else absolute."""
    absolute = path.resolve()
    try:
        return absolute.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(absolute)


def _refuse_taken(pkg: str, target: Path) -> None:
    spec = importlib.util.find_spec(pkg)
    if spec is not None:
        where = spec.origin or ", ".join(spec.submodule_search_locations or [])
        raise ValueError(f"new-env: a module named {pkg!r} is already importable ({where}); pick another")
    if target.exists():
        raise ValueError(f"new-env: {_shown(target)} already exists; pick another name or --dir")


def new_env(args: argparse.Namespace) -> list[str]:
    """Write the package; the next-steps lines to print."""
    n = names(args.name)
    target = args.dir / n.pkg
    _refuse_taken(n.pkg, target)
    workspace = None if args.no_register else workspace_of(target)
    rel = _shown(target)
    install = "" if workspace else f"uv pip install -e {rel}   # installs it into the project's venv"
    files = render(args.name, _kind(args), seats=args.seats or 2, rel=rel, install=install)
    for path, text in files.items():
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        (target / path).write_text(text)
    lines = [f"wrote {rel}/: " + ", ".join(sorted(files))]
    if workspace is not None and register(workspace, n.dash):
        lines.append(f"listed {n.dash} in {_shown(workspace)} (dependencies, [tool.uv.sources]): the next "
                     "`uv run` installs it and updates uv.lock (commit both with the package)")  # fmt: skip
    lines += ["next:", *(f"  {step}" for step in _next_steps(rel, install))]
    return lines


def _next_steps(rel: str, install: str) -> list[str]:
    steps = [install] if install else []
    return [
        *steps,
        f"uv run pytest -n 0 {rel}/tests   # the game logic, then episodes on the tiny model",
        f"uv run rl @ {rel}/rl_tiny.toml   # train 5 steps on the tiny model",
        f"then edit {rel}/ and read docs/environments.md (writing an environment, troubleshooting)",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        lines = new_env(args)
    except (ValueError, OSError) as e:
        print(str(e) if str(e).startswith("new-env:") else f"new-env: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
