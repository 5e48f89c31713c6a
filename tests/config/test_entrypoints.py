"""`entrypoints/common.py`: the error policy around a component's `run(cfg)` and the logging set-up;
`entrypoints/commands.py`: every command of the table names a config class and a run function that exist."""

from __future__ import annotations

import ast
import importlib.util
import logging
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_async.config.base import BaseConfig
from prime_async.config.shared import LogConfig
from prime_async.entrypoints.commands import COMMANDS
from prime_async.entrypoints.common import run_component, setup_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_component_gets_the_config() -> None:
    seen: list[object] = []
    cfg = object()
    run_component(seen.append, cfg, component="demo")
    assert seen == [cfg]


def test_value_error_is_one_line_and_exit_2(restore_logging: None, capsys: pytest.CaptureFixture) -> None:
    setup_logging(LogConfig(), component="demo")

    def run(cfg: object) -> None:
        raise ValueError("model.path: /nope has no config.json")

    with pytest.raises(SystemExit) as exit_info:
        run_component(run, object(), component="demo")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "demo: error: model.path: /nope has no config.json" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_ctrl_c_exits_130_and_other_errors_keep_their_traceback() -> None:
    def interrupted(cfg: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        run_component(interrupted, object(), component="demo")
    assert exit_info.value.code == 130

    def crashed(cfg: object) -> None:
        raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        run_component(crashed, object(), component="demo")


def test_plain_logs_name_component_and_rank(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    setup_logging(LogConfig(level="INFO"), component="trainer")
    logging.getLogger("prime_async.trainer.train").info("step 3")
    logging.getLogger("httpx").info("request noise")
    err = capsys.readouterr().err
    assert "[trainer:rank1] prime_async.trainer.train: step 3" in err
    assert "request noise" not in err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_names_a_config_class_and_a_run_function(name: str) -> None:
    """The table's `module:attribute` strings resolve: the config class is imported (no torch), the run
    function is found in its module's source without importing it (torch, verifiers)."""
    command = COMMANDS[name]
    assert command.name == name and issubclass(command.config_class(), BaseConfig)
    module, attribute = f"prime_async.{command.run}".split(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{name}: no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert attribute in defined | imported, f"{name}: {module} defines no {attribute}"


def test_console_scripts_are_the_table_or_a_command_of_their_own() -> None:
    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    for script, target in scripts.items():
        module, attribute = target.split(":")
        assert module == f"prime_async.entrypoints.{script.replace('-', '_')}" and attribute == "main"
    assert set(COMMANDS) <= set(scripts), f"commands without a console script: {set(COMMANDS) - set(scripts)}"
