"""The files of a new environment package: names from the env id, templates filled per kind.

    NAME ──► Names (dash id, package, class prefix) ──► render(kind, seats) ──► {relative path: text}

Invariants: `render` is a pure function of its arguments (the same call gives the same files, byte for
byte); every kind writes a pyproject.toml, a README.md, the package (`__init__.py` exporting one
`vf.Taskset`, and the env module: taskset, task, a `@vf.reward`, a `@vf.metric`), `rl_tiny.toml` and
`tests/test_<package>.py`; a name that is not a valid id is a ValueError naming it.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Literal

Kind = Literal["single_turn", "multi_turn", "tools", "seats"]
KINDS: tuple[Kind, ...] = ("single_turn", "multi_turn", "tools", "seats")
MAX_SEATS = 8
_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")

SUMMARIES: dict[Kind, str] = {
    "single_turn": "add two numbers, one answer",
    "multi_turn": "guess the number, the env answers higher or lower",
    "tools": "guess the number with a check tool",
    "seats": "guess the number, seats taking turns",
}
DESCRIPTIONS: dict[Kind, str] = {
    "single_turn": (
        "A single-turn verifiers v1 environment: the model adds two numbers. Reward `correct` (1.0 iff the "
        "first number of the reply is the sum); metric `reply_chars`."
    ),
    "multi_turn": (
        "A multi-turn verifiers v1 environment: the model guesses a secret number and the env answers "
        '"Higher." or "Lower." after each wrong guess, up to `max_guesses` turns. Reward `hit` (1.0 when a '
        "guess is the number); metric `guesses` (model turns used)."
    ),
    "tools": (
        "A tool-calling verifiers v1 environment: the model guesses a secret number with a `check` tool "
        '(an MCP `vf.Toolset`; it answers "higher", "lower" or "correct") and finishes with '
        "`<answer>N</answer>`. Reward `hit` (1.0 iff the answer is the number); metric `tool_calls`."
    ),
    "seats": (
        "A multi-agent verifiers v1 environment: {seats} seats take turns guessing one secret number; the "
        'env tells the next seat the last guess and "higher" or "lower". Each seat is trained on its own '
        "reward `hit` (1.0 when its guess is the number); metric `guesses` (the seat's turns)."
    ),
}
SEQ_LEN: dict[Kind, int] = {"single_turn": 256, "multi_turn": 1024, "tools": 1024, "seats": 1024}
MAX_TOKENS: dict[Kind, int] = {"single_turn": 8, "multi_turn": 8, "tools": 32, "seats": 8}


@dataclass(frozen=True)
class Names:
    """The spellings of one environment name."""

    dash: str
    """The id and distribution name (`guess-number`)."""
    pkg: str
    """The import package and directory name (`guess_number`)."""
    prefix: str
    """The class name prefix (`GuessNumber`)."""


def names(name: str) -> Names:
    """`guess-number` / `guess_number` -> Names; ValueError for anything that is not a plain id."""
    raw = name.strip()
    if not _NAME.match(raw):
        raise ValueError(
            f"new-env: name {name!r} is not an environment id: use lowercase letters, digits and single "
            "dashes or underscores, starting with a letter (e.g. guess-number)"
        )
    pkg = raw.replace("-", "_")
    if keyword.iskeyword(pkg):
        raise ValueError(f"new-env: name {name!r} is a Python keyword; pick another")
    prefix = "".join(part.capitalize() for part in pkg.split("_"))
    return Names(dash=pkg.replace("_", "-"), pkg=pkg, prefix=prefix)


def _template(kind: str, filename: str) -> str:
    return resources.files(__package__).joinpath("templates", kind, filename + ".tmpl").read_text()


def _fill(text: str, values: dict[str, str]) -> str:
    return Template(text).substitute(values)


def seat_names(seats: int) -> list[str]:
    """The seat (agent config field) names of a `seats`-seat env."""
    return [f"player_{i}" for i in range(1, seats + 1)]


def _values(n: Names, kind: Kind, seats: int, rel: str) -> dict[str, str]:
    seat_list = seat_names(seats)
    flags = {"single_turn": "", "multi_turn": "--multi-turn", "tools": "--tools", "seats": f"--seats {seats}"}
    return {
        "dash": n.dash, "pkg": n.pkg, "Prefix": n.prefix, "rel": rel, "flags": flags[kind],
        "summary": SUMMARIES[kind], "description": DESCRIPTIONS[kind].format(seats=seats),
        "seq_len": str(SEQ_LEN[kind]), "max_tokens": str(MAX_TOKENS[kind]), "seats": str(seats),
        "seat_fields": "\n".join(f'    {s}: vf.AgentConfig = vf.AgentConfig()\n    """Seat {i}."""'
                                 for i, s in enumerate(seat_list, start=1)),
        "seat_tuple": "(" + ", ".join(f'"{s}"' for s in seat_list) + ("," if seats == 1 else "") + ")",
    }  # fmt: skip


def render(
    name: str, kind: Kind, *, seats: int = 2, rel: str | None = None, install: str = ""
) -> dict[str, str]:
    """The package's files, `{path relative to the package directory: text}`; `rel` is the package
    directory as the README's and config's commands name it (default `environments/<package>`),
    `install` the command the README puts first to install it (none for a workspace member)."""
    if kind not in KINDS:
        raise ValueError(f"new-env: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "seats" and not 2 <= seats <= MAX_SEATS:
        raise ValueError(f"new-env: --seats {seats}: a multi-agent env has 2 to {MAX_SEATS} seats")
    n = names(name)
    values = _values(n, kind, seats, rel or f"environments/{n.pkg}")
    values["install"] = f"{install}\n" if install else ""
    files = {
        "pyproject.toml": _fill(_template("common", "pyproject.toml"), values),
        "README.md": _fill(_template("common", "README.md"), values),
        "rl_tiny.toml": _fill(_template("common", "rl_tiny.toml"), values),
        f"{n.pkg}/__init__.py": _fill(_template(kind, "__init__.py"), values),
        f"{n.pkg}/env.py": _fill(_template(kind, "env.py"), values),
    }
    if kind == "tools":
        files[f"{n.pkg}/tools.py"] = _fill(_template(kind, "tools.py"), values)
    episode_test = _fill(_template("common", "episode_test.py"), values).rstrip("\n")
    test = _fill(_template(kind, "test.py"), {**values, "episode_test": episode_test})
    files[f"tests/test_{n.pkg}.py"] = test
    return files
