"""`entrypoints/common.py`: the error policy around a component's `run(cfg)` and the logging set-up."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from prime_async.config.shared import LogConfig
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
