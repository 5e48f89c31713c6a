"""The broadcast directory layout (`prime_async.weights.broadcasts`) on real files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from prime_async.weights.broadcasts import (
    STABLE,
    discard_after,
    install_version,
    latest_stable,
    version_dir,
    versions,
)


def _stage(root: Path, version: int, payload: str) -> Path:
    staged = root / f".tmp_step_{version}"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_text(payload)
    (staged / STABLE).write_text(f"{version}\n")
    return staged


def test_rollback_discards_the_abandoned_history(tmp_path: Path) -> None:
    for v in range(1, 6):
        install_version(tmp_path, v, _stage(tmp_path, v, f"v{v}"))
    assert discard_after(tmp_path, 2) == [3, 4, 5]
    assert versions(tmp_path) == [1, 2] and latest_stable(tmp_path) == 2
    install_version(tmp_path, 3, _stage(tmp_path, 3, "v3 of the new history"))
    assert latest_stable(tmp_path) == 3
    assert (version_dir(tmp_path, 3) / "model.safetensors").read_text() == "v3 of the new history"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_republishing_a_version_never_shows_a_partial_directory(tmp_path: Path) -> None:
    """A reader polling `step_1` sees it complete (STABLE + weights) or absent, never STABLE alone.

    Each look lists the directory once (one getdents on one inode), so the check cannot straddle the
    swap of the old copy for the new one; a payload it reads is either version's, never a mix."""
    install_version(tmp_path, 1, _stage(tmp_path, 1, "old"))
    partial: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        d = version_dir(tmp_path, 1)
        while not stop.is_set():
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                continue  # between the rename away and the rename into place: absent, allowed
            if STABLE in names and "model.safetensors" not in names:
                partial.append(f"STABLE without weights: {names}")
            try:
                if (d / "model.safetensors").read_text() not in ("old", "new"):
                    partial.append("bad payload")
            except FileNotFoundError:
                pass

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(200):
        install_version(tmp_path, 1, _stage(tmp_path, 1, "new" if i % 2 else "old"))
    stop.set()
    thread.join()
    assert not partial
