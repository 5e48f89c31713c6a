"""`new-env`: the files it writes for every kind (lint-clean, importable, their own tests pass), the
workspace registration, the refusals, and environments/higher_lower being exactly its output."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prime_async.config.loader import parse_config
from prime_async.config.rl import RLConfig
from prime_async.entrypoints.new_env import main
from prime_async.scaffold.render import KINDS, names, render
from prime_async.scaffold.workspace import register, workspace_of

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FLAGS = {"single_turn": [], "multi_turn": ["--multi-turn"], "tools": ["--tools"], "seats": ["--seats", "3"]}
WORKSPACE = """\
[project]
name = "root"
version = "0.1.0"
dependencies = [
    "verifiers>=0.4.0",  # a comment with a ] in it
    "calculator",
]

[tool.uv.workspace]
members = ["environments/*"]

[tool.uv.sources]
calculator = { workspace = true }

[tool.ruff]
line-length = 110
"""


def write(tmp: Path, name: str, kind: str) -> Path:
    """The package of `new-env NAME <kind flags> --dir tmp` (outside any workspace: nothing registered)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        main([name, *FLAGS[kind], "--dir", str(tmp)])
    return tmp / names(name).pkg


def test_names_and_bad_input() -> None:
    assert names("guess-number") == names("guess_number")
    assert (names("guess-number").pkg, names("guess-number").prefix) == ("guess_number", "GuessNumber")
    for bad in ("Guess", "1up", "a--b", "my env", "a/b", ""):
        with pytest.raises(ValueError, match="is not an environment id"):
            names(bad)
    with pytest.raises(ValueError, match="keyword"):
        names("class")
    with pytest.raises(ValueError, match="2 to 8 seats"):
        render("x", "seats", seats=1)


def test_every_kind_writes_the_same_complete_package(tmp_path: Path) -> None:
    for kind in KINDS:
        files = render("guess-number", kind)
        assert files == render("guess-number", kind), "render is a pure function"
        expected = {"pyproject.toml", "README.md", "rl_tiny.toml", "guess_number/__init__.py",
                    "guess_number/env.py", "tests/test_guess_number.py"}  # fmt: skip
        assert expected <= set(files), kind
        assert "@vf.reward" in files["guess_number/env.py"] and "@vf.metric" in files["guess_number/env.py"]
        project = tomllib.loads(files["pyproject.toml"])["project"]
        assert project["name"] == "guess-number" and project["dependencies"] == ["verifiers>=0.4.0"]
        rl = tomllib.loads(files["rl_tiny.toml"])
        assert rl["orchestrator"]["env"]["id"] == "guess-number" and rl["model"]["build"] == "tiny"
        (tmp_path / "rl.toml").write_text(files["rl_tiny.toml"])
        cfg = parse_config(RLConfig, ["@", str(tmp_path / "rl.toml")], prog="rl")  # as `rl` reads it
        assert [env.id for env in cfg.orchestrator.envs] == ["guess-number"], kind
        assert "${" not in "".join(files.values()), kind


@pytest.mark.parametrize("kind", KINDS)
def test_generated_package_is_clean_loads_and_passes_its_logic_tests(kind: str, tmp_path: Path) -> None:
    pkg = write(tmp_path, "guess-number", kind)
    for cmd in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        lint = subprocess.run([str(BIN / "ruff"), *cmd, str(pkg)], capture_output=True, text=True, cwd=ROOT)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    probe = (
        "from verifiers.v1.utils.loaders import environment_class, taskset_class\n"
        "print(taskset_class('guess-number').__name__, environment_class('guess-number').__name__)"
    )
    cmd = [sys.executable, "-c", probe]
    loaded = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    own_env = {"multi_turn": "GuessNumberEnv", "seats": "GuessNumberEnv"}.get(kind, "SingleAgentEnv")
    assert loaded.stdout.split() == ["GuessNumberTaskset", own_env]
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:randomly", "-q", str(pkg / "tests"),
           "-k", "not tiny_model", "-p", "no:cacheprovider"]  # fmt: skip
    tests = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]


def test_a_package_in_a_workspace_is_listed_in_its_root_pyproject(tmp_path: Path, capsys) -> None:
    (tmp_path / "pyproject.toml").write_text(WORKSPACE)
    (tmp_path / "environments").mkdir()
    assert workspace_of(tmp_path / "environments" / "x") == tmp_path / "pyproject.toml"
    assert workspace_of(tmp_path / "other" / "x") is None
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        main(["guess-number", "--multi-turn"])
    out = capsys.readouterr().out
    data = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    assert data["project"]["dependencies"] == ["verifiers>=0.4.0", "calculator", "guess-number"]
    assert data["tool"]["uv"]["sources"]["guess-number"] == {"workspace": True}
    assert data["tool"]["ruff"] == {"line-length": 110}, "the tables after the sources are kept"
    expected = WORKSPACE.replace('"calculator",\n', '"calculator",\n    "guess-number",\n').replace(
        "calculator = { workspace = true }\n",
        "calculator = { workspace = true }\nguess-number = { workspace = true }\n",
    )
    assert (tmp_path / "pyproject.toml").read_text() == expected, "the layout is kept, one line added to each"
    assert "listed guess-number in pyproject.toml" in out and "uv pip install" not in out
    assert any(
        line.startswith("  uv run rl @ environments/guess_number/rl_tiny.toml ") for line in out.splitlines()
    )
    readme = (tmp_path / "environments" / "guess_number" / "README.md").read_text()
    assert "uv run rl @ environments/guess_number/rl_tiny.toml" in readme
    assert register(tmp_path / "pyproject.toml", "guess-number") is False, "listed once"


def test_register_one_line_array_and_no_sources_table(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "r"\ndependencies = ["a"]\n\n[tool.uv.workspace]\nmembers = []\n')
    assert register(pyproject, "new-one")
    data = tomllib.loads(pyproject.read_text())
    assert data["project"]["dependencies"] == ["a", "new-one"]
    assert data["tool"]["uv"]["sources"] == {"new-one": {"workspace": True}}
    pyproject.write_text('[project]\nname = "r"\n')
    with pytest.raises(ValueError, match="add it by hand"):
        register(pyproject, "new-one")


def test_outside_a_workspace_the_next_steps_install_it(tmp_path: Path, capsys) -> None:
    write(tmp_path, "guess-number", "multi_turn")
    out = capsys.readouterr().out
    assert "uv pip install -e guess_number" in out and "listed" not in out
    readme = (tmp_path / "guess_number" / "README.md").read_text()
    assert "uv pip install -e guess_number" in readme


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["json"], "a module named 'json' is already importable"),
        (["exists"], "already exists"),
        (["Bad Name"], "is not an environment id"),
        (["x", "--seats", "9"], "2 to 8 seats"),
    ],
)
def test_refusals_exit_2_with_one_line(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "exists").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_higher_lower_is_exactly_what_new_env_writes() -> None:
    """environments/higher_lower (the guess-the-number env) is `new-env higher-lower --multi-turn`."""
    files = render("higher-lower", "multi_turn")
    on_disk = ROOT / "environments" / "higher_lower"
    written = {p: (on_disk / p).read_text() for p in files}
    assert written == files, "rewrite it: new-env higher-lower --multi-turn"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_generated_multi_turn_tests_pass_on_the_tiny_model(tmp_path: Path) -> None:
    """The generated package's own tests, the episodes on the tiny model included."""
    pkg = write(tmp_path, "guess-number", "multi_turn")
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:randomly", "-q", str(pkg / "tests"),
           "-p", "no:cacheprovider"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=850)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:]
