"""Artifacts built once per test run and shared by every xdist worker (the tiny model, the SmolLM2
conversion)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this test run sees (the run's base temp dir); the worker's own
    base temp dir without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`shared_run_dir/name`, built by `build(path)` by the first worker that asks (under a file lock;
    a `.done` marker is written last, so a worker never sees a half-built directory)."""
    from filelock import FileLock

    root = shared_run_dir(tmp_path_factory)
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            build(path)
            done.write_text("ok\n")
    return path
