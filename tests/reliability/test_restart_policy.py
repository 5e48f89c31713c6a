"""The rl launcher's restart policy on real files (no processes): which config a dead component gets."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from prime_async.config.rl import RLConfig
from prime_async.launcher.restart import (
    RestartBudget,
    align_orchestrator_checkpoints,
    latest_stable_broadcast,
    restart_overrides,
    trainer_checkpoint_step,
    write_restart_config,
)
from prime_async.launcher.rl import write_sub_configs


def _cfg(tmp_path: Path, **kw) -> RLConfig:
    return RLConfig.model_validate({"output_dir": str(tmp_path), **kw})


def test_inference_restarts_with_the_newest_stable_broadcast(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert restart_overrides(cfg, "inference") == {}  # nothing published yet: the original v0 config
    for step, stable in ((3, True), (4, True), (5, False)):  # step_5 is still being written
        d = tmp_path / "broadcasts" / f"step_{step}"
        d.mkdir(parents=True)
        if stable:
            (d / "STABLE").write_text(f"{step}\n")
    (tmp_path / "broadcasts" / ".tmp_step_6").mkdir()
    assert latest_stable_broadcast(tmp_path) == 4
    overrides = restart_overrides(cfg, "inference")
    assert overrides == {"model": {"path": str(tmp_path / "broadcasts" / "step_4")}, "weight_version": 4}
    paths = write_sub_configs(cfg, tmp_path / "configs")
    path = write_restart_config(paths["inference"], overrides, 1)
    data = tomllib.loads(path.read_text())
    assert path.name == "inference.restart1.toml"
    assert data["model"]["path"].endswith("step_4") and data["weight_version"] == 4
    assert data["server"] == tomllib.loads(paths["inference"].read_text())["server"]  # the rest is kept


def test_trainer_restart_resumes_when_a_checkpoint_exists(tmp_path: Path) -> None:
    assert restart_overrides(_cfg(tmp_path), "trainer") == {}  # no checkpoints at all: the run starts over
    cfg = _cfg(tmp_path, trainer={"ckpt": {"interval": 2}})
    assert restart_overrides(cfg, "trainer") == {}  # died before its first checkpoint: start over
    root = tmp_path / "checkpoints" / "trainer"
    (root / "step_2").mkdir(parents=True)
    (root / "step_2" / "COMPLETE").write_text("")
    (root / "step_4").mkdir()  # incomplete: never used
    assert trainer_checkpoint_step(tmp_path) == 2
    assert restart_overrides(cfg, "trainer") == {"ckpt": {"resume": True}}
    assert restart_overrides(cfg, "orchestrator") == {"data": {"ckpt": {"resume": True}}}


def test_orchestrator_checkpoints_ahead_of_the_trainer_are_moved_aside(tmp_path: Path) -> None:
    from prime_async.orchestrator.ckpt import latest_checkpoint, save_checkpoint

    for step in range(6):
        save_checkpoint(tmp_path, step, {"data": {"position": step}})
    assert align_orchestrator_checkpoints(tmp_path, 4) == [4, 5]
    assert latest_checkpoint(tmp_path)["step"] == 3  # the orchestrator resumes at batch 4, as the trainer
    aside = sorted(p.name for p in (tmp_path / "checkpoints" / "orchestrator").glob(".ahead_*"))
    assert aside == [".ahead_step_4.json", ".ahead_step_5.json"]
    assert json.loads((tmp_path / "checkpoints" / "orchestrator" / aside[0]).read_text())["step"] == 4


def test_restart_budget_is_per_component() -> None:
    budget = RestartBudget(max_restarts=1)
    assert budget.allows("inference") and budget.allows("trainer")
    budget.take("inference")
    assert not budget.allows("inference") and budget.allows("trainer")
    assert not RestartBudget(max_restarts=0).allows("trainer")
    assert not budget.allows("progress")
    assert RLConfig().restart.max_restarts == 0  # default: a death fails the run, as before


def test_orchestrator_checkpoints_on_the_trainer_checkpoint_steps(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, trainer={"ckpt": {"interval": 5}})
    assert cfg.orchestrator.data.ckpt.interval == 5
    assert _cfg(tmp_path, trainer={"ckpt": {"interval": 6}}, orchestrator={"data": {"ckpt": {"interval": 3}}})
    with pytest.raises(
        ValueError, match=r"orchestrator.data.ckpt.interval = 4 does not divide trainer.ckpt.interval"
    ):
        _cfg(tmp_path, trainer={"ckpt": {"interval": 6}}, orchestrator={"data": {"ckpt": {"interval": 4}}})
