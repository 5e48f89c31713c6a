"""GPU placement of `rl` (`config/placement.py`): components -> device sets -> overlaps, the automatic
placement on 0, 1 and several devices, the weight transport it chooses, and each refusal as one line
(exit 2 through `rl --dry-run` for the machine-independent ones, through `rl` start for the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_async.config.loader import ConfigError, load_config, parse_config
from prime_async.config.placement import (
    Overlap,
    assign_devices,
    child_visible_devices,
    find_overlaps,
    place,
    ranks_vs_devices,
    shared_device_transport,
)
from prime_async.config.rl import RLConfig

GPU_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "gpu"
TWO_RANKS = ["--trainer.num-processes", "2"]
DISTRIBUTED = ["--weights.transport", "distributed"]
SHARED = shared_device_transport()
SHARED_ARGS = ["--weights.transport", str(SHARED), "--trainer.runtime.mem-fraction", "0.5",
               "--inference.engine.mem-fraction", "0.4"]  # fmt: skip


def rl(argv: list[str]) -> RLConfig:
    return load_config(RLConfig, argv)


def start_refusal(argv: list[str], num_devices: int) -> str:
    """The one line `rl` refuses a valid config with on a machine of `num_devices` CUDA devices."""
    with pytest.raises(ValueError) as info:
        place(rl(argv), num_devices)
    message = str(info.value)
    assert "\n" not in message, "a refusal is one line"
    return message


def dry_run_refusal(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """`rl ... --dry-run`: exit 2 and one line on stderr."""
    with pytest.raises(SystemExit) as info:
        parse_config(RLConfig, [*argv, "--dry-run"], prog="rl")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------------ pure functions


def test_overlaps_of_device_sets() -> None:
    assert find_overlaps({"inference": [0, 1], "trainer": [2, 3]}) == []
    assert find_overlaps({"inference": [0, 1], "teacher_inference": [1], "trainer": [1, 2]}) == [
        Overlap("inference", "teacher_inference", (1,)),
        Overlap("inference", "trainer", (1,)),
        Overlap("teacher_inference", "trainer", (1,)),
    ]
    assert find_overlaps({"trainer": [0, 0, 1]}) == [Overlap("trainer", "trainer", (0,))]
    assert find_overlaps({}) == []


def test_automatic_placement_side_by_side_then_one_device() -> None:
    needs = {"inference": 2, "teacher_inference": 1, "trainer": 2}
    assert assign_devices(needs, {}, 5) == {"inference": [0, 1], "teacher_inference": [2], "trainer": [3, 4]}
    # an explicit list keeps its devices; the others fill the rest in component order
    assert assign_devices(needs, {"trainer": [0, 1]}, 5) == {
        "trainer": [0, 1], "inference": [2, 3], "teacher_inference": [4],
    }  # fmt: skip
    assert assign_devices({"inference": 1, "trainer": 1}, {}, 1) == {"inference": [0], "trainer": [0]}


def test_automatic_placement_shares_when_side_by_side_does_not_fit() -> None:
    """The trainer's ranks take the last devices, the engines the others in turn (all when none is left)."""
    needs = {"inference": 2, "teacher_inference": 1, "trainer": 2}
    assert assign_devices(needs, {}, 4) == {"trainer": [2, 3], "inference": [0, 1], "teacher_inference": [0]}
    one_each = {"inference": 1, "teacher_inference": 1, "trainer": 1}
    assert assign_devices(one_each, {}, 2) == {"trainer": [1], "inference": [0], "teacher_inference": [0]}
    assert assign_devices(one_each, {}, 1) == {"trainer": [0], "inference": [0], "teacher_inference": [0]}
    assert assign_devices({"inference": 1, "trainer": 2}, {}, 2) == {"trainer": [0, 1], "inference": [0]}
    assert assign_devices({"inference": 1, "trainer": 2}, {}, 1)["trainer"] == [0], "ranks_vs_devices refuses"
    # explicit lists keep their devices; the automatic ones share what is left
    assert assign_devices(one_each, {"teacher_inference": [0]}, 2) == {
        "teacher_inference": [0], "inference": [1], "trainer": [1],
    }  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^gpus.inference: \[inference\] needs 3 devices .* 2 of the 2 visible"
    ):
        assign_devices({"inference": 3, "trainer": 1}, {}, 2)


def test_ranks_vs_devices() -> None:
    assert ranks_vs_devices(2, 2, where="gpus.trainer = [0, 1]") is None
    refusal = ranks_vs_devices(2, 1, where="gpus.trainer = [0]")
    assert refusal is not None and refusal.startswith("trainer.num_processes = 2 with 1 CUDA device")
    assert "gpus.trainer = [0]" in refusal


def test_child_visible_devices_translates_through_the_parents_list() -> None:
    assert child_visible_devices(None, [0, 1]) == "0,1"
    assert child_visible_devices("4,5,6", [1, 2]) == "5,6", "the child's value replaces the parent's"
    assert child_visible_devices("GPU-aa, GPU-bb", [1]) == "GPU-bb"
    with pytest.raises(ValueError, match="device index 2 is not among the 2 devices"):
        child_visible_devices("4,5", [2])
    with pytest.raises(ValueError, match="not among the 0 devices"):
        child_visible_devices("", [0])  # "" hides every device; never widen it


# ------------------------------------------------------------------------------------- rl placement


def test_no_cuda_places_nothing_and_keeps_the_transport() -> None:
    for argv in ([], TWO_RANKS, ["--gpus.inference", "[0]", "--gpus.trainer", "[0]"]):
        placement = place(rl(argv), 0)
        assert placement.devices == {} and placement.transport == "filesystem"


def test_one_device_shares_it_with_the_shared_weight_path() -> None:
    placement = place(rl([]), 1)
    assert placement.devices == {"inference": [0], "trainer": [0]}
    assert SHARED is not None and placement.transport == SHARED
    # an explicit transport is kept: filesystem works on one device
    placement = place(rl(["--weights.transport", "filesystem"]), 1)
    assert placement.transport == "filesystem"
    # a run the shared path cannot serve (SGLang) keeps the default, which works on one device
    sglang = place(rl(["--inference.backend", "sglang"]), 1)
    assert sglang.devices == {"inference": [0], "trainer": [0]} and sglang.transport == "filesystem"


def test_two_devices_place_engine_and_trainer_apart() -> None:
    placement = place(rl([]), 2)
    assert placement.devices == {"inference": [0], "trainer": [1]} and placement.transport == "filesystem"
    assert place(rl(DISTRIBUTED), 2).transport == "distributed"
    cpu_engine = place(rl(["--inference.engine.device", "cpu"]), 1)
    assert cpu_engine.devices == {"trainer": [0]}, "an engine on the CPU takes no device"


def test_gpu_configs_place_as_their_comments_say() -> None:
    def placed(name: str, num_devices: int):
        return place(load_config(RLConfig, ["@", str(GPU_CONFIGS / name)]), num_devices)

    one = placed("rl_1gpu.toml", 1)
    assert one.devices == {"inference": [0], "trainer": [0]} and one.transport == SHARED
    two = placed("rl_2gpu.toml", 2)
    assert two.devices == {"inference": [0], "trainer": [1]} and two.transport == "distributed"
    four = placed("rl.toml", 4)
    assert four.devices == {"inference": [0, 1], "trainer": [2, 3]} and four.transport == "filesystem"
    with pytest.raises(ValueError, match=r"gpus.trainer = \[1\] names device 1, and 1 CUDA device"):
        placed("rl_2gpu.toml", 1)


# --------------------------------------------------------------------------- refusals at rl start


def test_distributed_weights_on_one_device_are_refused_naming_both_keys() -> None:
    """The first GPU run: NCCL's 'Duplicate GPU detected' at the first update, now refused at start."""
    error = start_refusal(DISTRIBUTED, 1)
    assert error.startswith("weights.transport = 'distributed' with gpus.inference = [0] (placed by rl)")
    assert "gpus.trainer = [0] (placed by rl)" in error and "Duplicate GPU" in error


def test_two_trainer_ranks_on_one_device_are_refused() -> None:
    """The first GPU run: rank 1 asked for cuda:1 on a one-GPU machine ('invalid device ordinal')."""
    error = start_refusal(TWO_RANKS, 1)
    assert error.startswith("trainer.num_processes = 2 with 1 CUDA device(s) for the trainer")
    assert place(rl(TWO_RANKS), 3).devices == {"inference": [0], "trainer": [1, 2]}
    two = place(rl(TWO_RANKS), 2)  # engine and trainer rank 0 share device 0: filesystem weights
    assert two.devices == {"trainer": [0, 1], "inference": [0]} and two.transport == "filesystem"
    with pytest.raises(ValueError, match=r"weights.transport = 'distributed' with gpus.inference"):
        place(rl([*TWO_RANKS, *DISTRIBUTED]), 2)


def test_more_than_the_visible_devices_is_refused() -> None:
    error = start_refusal(["--gpus.trainer", "[3]"], 2)
    assert error.startswith("gpus.trainer = [3] names device 3, and 2 CUDA device(s) are visible")
    sglang = ["--inference.backend", "sglang", "--inference.sglang.num-engines", "3"]
    error = start_refusal(sglang, 2)
    assert error.startswith("gpus.inference: [inference] needs 3 devices (SGLang: num_engines * tp * dp)")


def test_shared_path_needs_the_engine_on_the_trainers_device() -> None:
    error = start_refusal(SHARED_ARGS, 2)  # auto placement puts them apart
    assert error.startswith(f"weights.transport = '{SHARED}' with gpus.inference = [0] (placed by rl)")
    assert "gpus.trainer = [1] (placed by rl)" in error
    assert place(rl(SHARED_ARGS), 0).transport == SHARED, "CPU: shared memory, no device"


# ------------------------------------------------------------- refusals at config time (--dry-run)


@pytest.mark.parametrize(
    ("argv", "start", "second_key"),
    [
        ([*DISTRIBUTED, "--gpus.inference", "[0]", "--gpus.trainer", "[0]"],
         "weights.transport = 'distributed' with gpus.inference = [0]", "gpus.trainer = [0]"),
        ([*TWO_RANKS, "--gpus.trainer", "[0]"],
         "trainer.num_processes = 2 with 1 CUDA device", "gpus.trainer"),
        ([*TWO_RANKS, "--gpus.trainer", "[1, 1]"], "gpus.trainer = [1, 1] names device 1 twice", "trainer"),
        (["--gpus.inference", "[0, 1]"], "gpus.inference = [0, 1] holds 2 device(s)", "embedded engine"),
        (["--inference.sglang.gpu-ids", "[0, 1]"], "inference.sglang.gpu_ids = [0, 1]", "gpus.inference"),
        (["--gpus.teacher-inference", "[1]"], "gpus.teacher_inference = [1] without", "[teacher_inference]"),
        ([*SHARED_ARGS, "--gpus.inference", "[0]", "--gpus.trainer", "[1]"],
         f"weights.transport = '{SHARED}' with gpus.inference = [0]", "gpus.trainer = [1]"),
    ],
)  # fmt: skip
def test_dry_run_refuses_in_one_line(
    argv: list[str], start: str, second_key: str, capsys: pytest.CaptureFixture
) -> None:
    err = dry_run_refusal(argv, capsys)
    assert err.startswith("rl: error: ") and start in err and second_key in err


def test_explicit_overlaps_train_with_a_transport_that_works_on_one_device() -> None:
    both_on_0 = ["--gpus.inference", "[0]", "--gpus.trainer", "[0]"]
    assert place(rl(both_on_0), 2).transport == SHARED
    assert place(rl([*both_on_0, "--weights.transport", "filesystem"]), 2).transport == "filesystem"
    with pytest.raises(ConfigError, match=r"weights.transport = 'distributed'"):
        rl([*both_on_0, *DISTRIBUTED])
