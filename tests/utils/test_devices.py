"""Device placement rules (`utils/devices.py`) and the trainer's ranks-vs-devices refusal, on CPU.

The refusal is fed device counts (a one-GPU machine is simulated by the count, not needed); the placement
helper is checked against a model on the meta device, so a tensor left on the CPU is caught here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_marks import device_skip_reason
from prime_async.trainer.train import check_ranks_fit_devices
from prime_async.utils.devices import model_device, on_model


@pytest.mark.parametrize(("ranks", "visible"), [(1, 1), (2, 2), (2, 8), (2, 0), (8, 0)])
def test_ranks_that_fit_are_accepted(ranks: int, visible: int) -> None:
    check_ranks_fit_devices(ranks, visible)  # visible = 0: no CUDA, CPU ranks always fit


def test_more_ranks_than_visible_devices_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as err:
        check_ranks_fit_devices(2, 1)
    line = str(err.value)
    assert "\n" not in line
    assert "trainer.num_processes = 2 with 1 CUDA device(s)" in line and "visible to this process" in line


def test_setup_distributed_refuses_before_asking_for_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of two on a one-GPU machine: refused at start (it asked for cuda:1 before)."""
    import prime_async.trainer.train as train

    monkeypatch.setattr(train, "cuda_device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)  # never reach init_process_group
    with pytest.raises(ValueError, match=r"trainer.num_processes = 2 with 1 CUDA device"):
        train.setup_distributed()


def test_needs_devices_skips_only_when_cuda_has_too_few() -> None:
    assert device_skip_reason(2, 1) == "needs 2 CUDA devices, 1 visible"
    assert device_skip_reason(2, 2) is None
    assert device_skip_reason(2, 0) is None  # no CUDA: the ranks run on the CPU


def test_model_device_is_where_the_parameters_are() -> None:
    model = torch.nn.Linear(3, 2, device="meta")
    assert model_device(model) == torch.device("meta")
    fed = on_model(model, np.arange(4))
    assert fed.device == torch.device("meta") and fed.dtype == torch.int64
    assert on_model(model, [1.0, 2.0], dtype=torch.float64).device.type == "meta"


def test_model_device_refuses_split_or_empty_models() -> None:
    split = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="parameters are on cpu, meta"):
        model_device(split)
    with pytest.raises(ValueError, match="parameters are on none"):
        model_device(torch.nn.ReLU())
