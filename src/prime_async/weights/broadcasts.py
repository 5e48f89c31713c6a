"""The broadcast directory: where weight versions are published, one layout for every component.

    output_dir/broadcasts/step_<N>/   model.safetensors, config.json, tokenizer files, STABLE (written last)
                                      (LoRA runs: adapter_config.json, adapter_model.safetensors, STABLE)

Writers: `weights/writer.py` (publish, prune). Readers: `BroadcastDir` here (newest STABLE version to
load: `weights/loaders/filesystem.py`, the in-run eval), `launcher/restart.py` (version to restart
inference with, history to discard on a rollback).

Invariants:
- a version exists for readers only once `step_<N>/STABLE` exists, and a directory holding `STABLE` is
  always complete: directories are created under a hidden name and renamed into place, and removed by
  first renaming them out of the `step_<N>` namespace (`remove_version`), never deleted in place;
- version numbers follow the run's history: a rollback to version c (`discard_after`) removes every
  version > c before any newer one is published, so "newest by number" is "newest in history".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Protocol

STABLE = "STABLE"
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA version directory: PEFT layout
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def broadcasts_root(output_dir: Path | str) -> Path:
    return Path(output_dir) / "broadcasts"


def version_dir(root: Path | str, version: int) -> Path:
    """`root/step_<version>` (root = the broadcasts directory)."""
    return Path(root) / f"step_{version}"


def versions(root: Path | str) -> list[int]:
    """Every `step_<N>` directory under `root`, complete or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


def is_stable(root: Path | str, version: int) -> bool:
    return (version_dir(root, version) / STABLE).is_file()


def latest_stable(root: Path | str) -> int | None:
    """Newest N with `root/step_N/STABLE`, or None."""
    return next((v for v in reversed(versions(root)) if is_stable(root, v)), None)


def remove_version(root: Path | str, version: int) -> None:
    """Take `step_<version>` away atomically for readers (rename), then delete it."""
    path = version_dir(root, version)
    doomed = Path(root) / f".removed_step_{version}_{uuid.uuid4().hex[:8]}"
    try:
        path.rename(doomed)
    except FileNotFoundError:
        return
    # STABLE goes first: a reader that opened the old directory before the rename never lists a
    # STABLE whose weights are already deleted.
    (doomed / STABLE).unlink(missing_ok=True)
    shutil.rmtree(doomed, ignore_errors=True)


def install_version(root: Path | str, version: int, staged: Path) -> Path:
    """Move the complete directory `staged` (STABLE inside) into place as `step_<version>`.

    Re-publishing an existing version replaces it without a reader ever seeing a partial directory: the
    old copy is renamed away first, so for a moment the version is absent, never incomplete."""
    final = version_dir(root, version)
    assert (staged / STABLE).is_file(), f"{staged} has no {STABLE} marker"
    remove_version(root, version)
    os.replace(staged, final)
    return final


def discard_after(root: Path | str, version: int) -> list[int]:
    """Remove every version > `version` (a rollback); returns the removed versions."""
    removed = [v for v in versions(root) if v > version]
    for v in removed:
        remove_version(root, v)
    return removed


def read_adapter_config(directory: Path) -> dict:
    """`adapter_config.json` of a PEFT adapter directory; ValueError naming what is wrong."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(f"{directory} is not a LoRA adapter directory: no {ADAPTER_CONFIG}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    return cfg


class Broadcasts(Protocol):
    """Where published weight versions are found."""

    def latest_stable(self) -> int | None: ...

    def path(self, version: int) -> str: ...


class BroadcastDir:
    """`root/step_N/` directories; a version counts only once `root/step_N/STABLE` exists."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def latest_stable(self) -> int | None:
        return latest_stable(self.root)

    def path(self, version: int) -> str:
        return str(version_dir(self.root, version))
