"""Fixtures of the GPU wheelhouse and GPU check tests: real wheels and a Python that has pip (the project
venv made by uv has none; the GPU image's python has one), both made offline."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def make_wheel(folder: Path, name: str, version: str, body: str = "X = 42\n") -> Path:
    """A minimal, valid pure-Python wheel `name-version-py3-none-any.whl` holding module `name`."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
        zf.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture(scope="session")
def pip_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv's python with pip (ensurepip: no network); skipped where ensurepip is missing."""
    venv = tmp_path_factory.mktemp("pip_venv")
    proc = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=120
    )
    python = venv / "bin" / "python"
    if proc.returncode != 0 or not python.exists():
        pytest.skip(f"no venv with pip here: {proc.stderr.strip()[-200:]}")
    return python
