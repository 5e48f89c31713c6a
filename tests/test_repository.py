"""Repository hygiene: the project is self-contained and its test doubles stay out of the runtime.

- no tracked text file refers to `../shared` (a directory outside the repository that a clone lacks);
- no runtime module imports `prime_async.testing` (simulators and synthetic data are for tests/benches);
- the pause-mode literals are spelled out once, in `prime_async/types.py`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "prime_async"


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_tracked_file_refers_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary (images, lock data): cannot hold a readable reference
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if "../shared" in line:
                offenders.append(f"{path.relative_to(ROOT)}:{i}")
    assert not offenders, f"files refer to ../shared (outside the repository): {offenders}"


def test_runtime_never_imports_the_testing_package():
    pattern = re.compile(r"^\s*(from|import)\s+prime_async\.testing\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in SRC.rglob("*.py")
        if "testing" not in p.relative_to(SRC).parts and pattern.search(p.read_text())
    ]
    assert not offenders, f"runtime modules import prime_async.testing: {offenders}"


def test_pause_mode_literals_are_defined_once():
    pattern = re.compile(r"Literal\[[^\]]*\"(retract|in_place|drain)\"")
    places = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert places == ["types.py"], f"pause-mode literals spelled out in {places}; import prime_async.types"
