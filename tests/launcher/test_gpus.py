"""`rl` at start on a machine of N CUDA devices (`launcher/gpus.py`): the CUDA_VISIBLE_DEVICES each
process gets, the weight transport it chooses on one device, and the placement refusals as one line with
exit 2 from the real `rl` entry point (the device count is the one thing faked: no GPU here)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_async.config.loader import load_config
from prime_async.config.placement import Placement, shared_device_transport
from prime_async.config.rl import RLConfig
from prime_async.entrypoints import rl as rl_entry
from prime_async.launcher import gpus
from prime_async.launcher.rl import build_processes

SHARED = shared_device_transport()


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _components(cfg: RLConfig, placement: Placement, tmp_path: Path) -> dict:
    paths = {name: tmp_path / f"{name}.toml" for name in ("inference", "trainer", "orchestrator",
                                                        "eval_inference", "teacher_inference")}  # fmt: skip
    return build_processes(cfg, paths, tmp_path / "logs", placement)


def test_each_process_sees_only_its_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(RLConfig, ["--trainer.num-processes", "2"])
    placement = Placement(devices={"inference": [0], "trainer": [1, 2]}, transport="filesystem")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    components = _components(cfg, placement, tmp_path)
    assert components["inference"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert components["trainer"].env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "CUDA_VISIBLE_DEVICES" not in components["orchestrator"].env, "the orchestrator needs no device"
    # under rl's own CUDA_VISIBLE_DEVICES the indices are its positions: a child's value replaces it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    components = _components(cfg, placement, tmp_path)
    assert components["inference"].env["CUDA_VISIBLE_DEVICES"] == "3"
    assert components["trainer"].env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert components["orchestrator"].env["CUDA_VISIBLE_DEVICES"] == "3,5,7"
    # and a started process sees exactly that value
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    seen = subprocess.run([sys.executable, "-c", code], env=components["trainer"].env, capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()  # fmt: skip
    assert seen == "5,7"


def test_no_cuda_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = load_config(RLConfig, ["--trainer.num-processes", "2", "--gpus.trainer", "[0, 1]"])
    placed, placement = gpus.place_run(cfg, num_devices=0)
    assert placed is cfg and placement.devices == {}
    components = _components(cfg, placement, tmp_path)
    assert all("CUDA_VISIBLE_DEVICES" not in c.env for c in components.values())


def test_one_device_takes_the_shared_path_in_every_component() -> None:
    cfg, placement = gpus.place_run(load_config(RLConfig, []), num_devices=1)
    assert placement.devices == {"inference": [0], "trainer": [0]}
    assert SHARED is not None
    transports = {cfg.weights.transport, cfg.trainer.weights.transport, cfg.orchestrator.weights.transport}
    assert transports == {SHARED}
    assert cfg.trainer.runtime.mem_fraction is not None and cfg.inference.engine.mem_fraction is not None
    two, _ = gpus.place_run(load_config(RLConfig, []), num_devices=2)
    assert two.weights.transport == "filesystem", "apart on two devices: the default stays"


def _rl_start(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """Run the `rl` entry point; it must refuse before starting anything: exit 2, one error line."""
    with pytest.raises(SystemExit) as info:
        rl_entry.main([*argv, "--output-dir", str(tmp_path / "run"), "--wandb.enabled", "false"])
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1, errors
    assert not (tmp_path / "run" / "logs").exists(), "nothing was started"
    return errors[0]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--weights.transport", "distributed"],
         "rl: error: weights.transport = 'distributed' with gpus.inference = [0] (placed by rl) and "
         "gpus.trainer = [0] (placed by rl) sharing device 0: NCCL refuses"),
        (["--trainer.num-processes", "2"],
         "rl: error: trainer.num_processes = 2 with 1 CUDA device(s) for the trainer (gpus.trainer = [0] "
         "(placed by rl))"),
    ],
)  # fmt: skip
def test_rl_refuses_what_broke_the_first_gpu_run_at_start(
    argv: list[str],
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    restore_logging: None,
) -> None:
    """One H200: distributed weights died at the first update ('Duplicate GPU detected'), trainer rank 1
    asked for cuda:1 ('invalid device ordinal'). Both are now one line before any process starts."""
    monkeypatch.setattr(gpus, "visible_cuda_devices", lambda: 1)
    assert line in _rl_start(argv, tmp_path, capsys)


@pytest.mark.gpu
def test_on_cuda_a_placed_process_sees_its_own_device_as_cuda_0(tmp_path: Path) -> None:
    """The real CUDA_VISIBLE_DEVICES effect: each child sees one device, and it is the one placed (same
    UUID as rl's device of that index), also when it is not rl's device 0."""
    import torch

    count = torch.cuda.device_count()
    assert gpus.visible_cuda_devices() == count
    placement = Placement(devices={"inference": [count - 1], "trainer": [0]}, transport="filesystem")
    components = _components(load_config(RLConfig, []), placement, tmp_path)
    code = "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)"
    for name, index in (("inference", count - 1), ("trainer", 0)):
        out = subprocess.run([sys.executable, "-c", code], env=components[name].env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()  # fmt: skip
        assert out == ["1", str(torch.cuda.get_device_properties(index).uuid)], name


@pytest.mark.gpu
def test_on_one_cuda_device_rl_refuses_distributed_weights_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture, restore_logging: None
) -> None:
    """The first GPU run's NCCL 'Duplicate GPU detected', on the real device count: one line, exit 2."""
    import torch

    if torch.cuda.device_count() != 1:
        pytest.skip(f"needs exactly 1 CUDA device, {torch.cuda.device_count()} visible")
    line = _rl_start(["--weights.transport", "distributed"], tmp_path, capsys)
    assert "weights.transport = 'distributed' with gpus.inference = [0]" in line
