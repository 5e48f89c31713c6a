"""GPU placement of an `rl` run: which CUDA devices each process `rl` starts may see (`[gpus]`).

`gpus.inference`, `gpus.eval_inference`, `gpus.teacher_inference` and `gpus.trainer` list device indices
as the `rl` process sees them (positions in its own `CUDA_VISIBLE_DEVICES` when that is set). `rl` starts
each component with `CUDA_VISIBLE_DEVICES` set to its devices, so inside a process they are
`cuda:0..n-1`: trainer rank i uses `cuda:i`, SGLang engine i of `inference` gets the i-th `tp * dp` of the
inference devices, the embedded engine `cuda:0`. An unset key lets `rl` place the component
(`assign_devices`), given N visible devices:
- N = 0 (no CUDA): placement is a no-op, no environment changes;
- the needs of all components fit side by side: consecutive devices, in the order inference,
  eval_inference, teacher_inference, trainer, skipping the devices placed explicitly;
- otherwise they share (`_share_devices`): the trainer's ranks take the last devices, the engines the
  others in turn (all of them when the trainer took every one); on one device every component is on 0.

Components on one device share it (its memory: the shared-device mode), except where that cannot work,
which is refused before anything starts, with one line naming both keys:
- one device named twice in a component's list (two ranks or engines of it on one device);
- trainer and inference on one device with `weights.transport = "distributed"`: NCCL refuses two ranks
  of the weight process group (trainer rank 0 + the inference engines) on one device ("Duplicate GPU
  detected");
- the shared-device weight path with an engine that is not on trainer rank 0's device;
- more trainer processes than devices for the trainer (`ranks_vs_devices`).
With one trainer rank and the inference engine on one device and `weights.transport` left at its
default, `rl` chooses the shared-device weight path when the run can take it (`shared_run`: the embedded
engine, each side's device share stated); otherwise the default (filesystem) stays, which works there.

Invariants: pure functions of config values and the device count (no torch import: `--dry-run` and the
config validation run them); `check_config` sees only explicit lists (machine-independent), `place`
adds the machine's device count and the automatic placement.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, Self

from pydantic import Field

from prime_async.config.base import BaseConfig
from prime_async.config.inference import InferenceConfig
from prime_async.config.shared import WeightsConfig
from prime_async.config.trainer import TrainerConfig

COMPONENTS = ("inference", "eval_inference", "teacher_inference", "trainer")  # order of auto placement
# Engines that take the trainer's weights over `weights.transport` (dedicated eval engines load
# broadcasts from disk, the teacher none), and with the trainer the ranks of the distributed weight group.
WEIGHT_TAKERS = ("inference",)
SHARED_TRANSPORT = "shared"
DeviceIndex = Annotated[int, Field(ge=0)]
_GPU_DOC = (
    " CUDA device indices as `rl` sees them (positions in its CUDA_VISIBLE_DEVICES when set); `rl` starts "
    "the process with CUDA_VISIBLE_DEVICES set to them. None = `rl` places it (docs/gpu.md)."
)


class GpusConfig(BaseConfig):
    """`[gpus]`: the CUDA devices of each process `rl` starts (see `config/placement.py`)."""

    inference: list[DeviceIndex] | None = Field(
        None,
        description="Devices of the inference engines (SGLang: num_engines * tp * dp; embedded: 1)."
        + _GPU_DOC,
    )
    eval_inference: list[DeviceIndex] | None = Field(
        None, description="Devices of the dedicated eval engines ([eval_inference])." + _GPU_DOC
    )
    teacher_inference: list[DeviceIndex] | None = Field(
        None, description="Devices of the teacher's engine (orchestrator.teacher.model)." + _GPU_DOC
    )
    trainer: list[DeviceIndex] | None = Field(
        None, description="Devices of the trainer, one per rank (trainer.num_processes)." + _GPU_DOC
    )


@dataclass(frozen=True)
class Overlap:
    """Devices that components `first` and `second` both list (`first == second`: named twice in one)."""

    first: str
    second: str
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """The devices of every component that needs some, and the weight transport the run uses."""

    devices: dict[str, list[int]]
    transport: str


class RunSections(Protocol):
    """What placement reads of an `rl` config (`RLConfig` has it; this module sits below `rl.py`)."""

    gpus: GpusConfig
    inference: InferenceConfig
    eval_inference: InferenceConfig | None
    teacher_inference: InferenceConfig | None
    trainer: TrainerConfig
    weights: WeightsConfig

    def given_values(self) -> dict[str, Any]: ...

    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...


# The device shares `use_shared_weights` states when the user left them unset: the trainer holds weights,
# gradients, optimizer state and its lent versions; the engine weights and KV cache; ~10% stays free for
# the two CUDA contexts and what no allocator caps.
SHARED_TRAINER_FRACTION, SHARED_ENGINE_FRACTION = 0.5, 0.4


def use_shared_weights(cfg: RunSections) -> RunSections:
    """`cfg` with `weights.transport = "shared"` and the device shares stated (the user's, else
    SHARED_TRAINER_FRACTION and SHARED_ENGINE_FRACTION), re-validated from what was given: what `rl`'s
    placement applies when trainer and engine land on one device. ValueError (one line) when the
    result is refused (e.g. SGLang, LoRA, the shares' sum above 1)."""
    data = cfg.given_values()
    data.setdefault("weights", {})["transport"] = "shared"
    runtime = data.setdefault("trainer", {}).setdefault("runtime", {})
    runtime.setdefault("mem_fraction", SHARED_TRAINER_FRACTION)
    engine = data.setdefault("inference", {}).setdefault("engine", {})
    engine.setdefault("mem_fraction", SHARED_ENGINE_FRACTION)
    return type(cfg).model_validate(data)


def shared_device_transport() -> str | None:
    """The `weights.transport` value of the shared-device weight path (CUDA IPC on one device, shared
    memory on CPU), None while the schema has none (it arrives with `weights/shared_*.py`)."""
    choices = typing.get_args(WeightsConfig.model_fields["transport"].annotation)
    return SHARED_TRANSPORT if SHARED_TRANSPORT in choices else None


def engine_devices_needed(inference: InferenceConfig) -> int:
    """Devices one engine section needs: SGLang num_engines * tp * dp, the embedded engine 1 (0 on CPU)."""
    if inference.backend == "sglang":
        sg = inference.sglang
        return sg.num_engines * sg.tp * sg.dp
    return 0 if inference.engine.device == "cpu" else 1


def device_needs(cfg: RunSections) -> dict[str, int]:
    """Devices each component of the run needs (components that need none are left out)."""
    needs = {
        name: engine_devices_needed(getattr(cfg, name)) for name in COMPONENTS[:-1] if getattr(cfg, name)
    }
    needs["trainer"] = cfg.trainer.num_processes
    return {name: n for name, n in needs.items() if n > 0}


def explicit_devices(cfg: RunSections) -> dict[str, list[int]]:
    """The lists given in `[gpus]`."""
    return {name: list(getattr(cfg.gpus, name)) for name in COMPONENTS if getattr(cfg.gpus, name) is not None}


def find_overlaps(devices: Mapping[str, Sequence[int]]) -> list[Overlap]:
    """Every pair of components that share a device, and every component that names a device twice."""
    overlaps = []
    names = list(devices)
    for i, first in enumerate(names):
        repeated = sorted({d for d in devices[first] if list(devices[first]).count(d) > 1})
        if repeated:
            overlaps.append(Overlap(first, first, tuple(repeated)))
        for second in names[i + 1 :]:
            shared = sorted(set(devices[first]) & set(devices[second]))
            if shared:
                overlaps.append(Overlap(first, second, tuple(shared)))
    return overlaps


def ranks_vs_devices(num_processes: int, num_devices: int, *, where: str) -> str | None:
    """The one-line refusal when `num_processes` trainer ranks would see fewer than one device each on
    CUDA (rank i uses cuda:i), else None. `where` says which devices, e.g. "gpus.trainer = [0]"."""
    if num_processes <= num_devices:
        return None
    return (
        f"trainer.num_processes = {num_processes} with {num_devices} CUDA device(s) for the trainer "
        f"({where}): each rank needs a device of its own (rank i uses cuda:i); set trainer.num_processes "
        f"<= {num_devices} or give the trainer more devices"
    )


def assign_devices(needs: Mapping[str, int], explicit: Mapping[str, Sequence[int]], num_devices: int) -> dict:
    """Devices of every component in `needs`: its explicit list, else automatic (module docstring).

    Raises ValueError (one line) when an engine needs more devices than there are to give it."""
    devices = {name: list(explicit[name]) for name in needs if name in explicit}
    auto = {name: needs[name] for name in COMPONENTS if name in needs and name not in explicit}
    free = [d for d in range(num_devices) if not any(d in ds for ds in devices.values())]
    if sum(auto.values()) <= len(free):
        for name, count in auto.items():
            devices[name], free = free[:count], free[count:]
    else:
        devices.update(_share_devices(auto, free or list(range(num_devices)), num_devices))
    return {name: devices[name] for name in COMPONENTS if name in devices}  # in component order


def _share_devices(needs: Mapping[str, int], pool: list[int], num_devices: int) -> dict[str, list[int]]:
    """Placement when the components do not fit side by side on `pool`: the trainer takes its ranks' devices
    from the end (all of `pool` when it has more ranks: `ranks_vs_devices` then refuses), the engines
    take the others in turn, sharing them, or all of `pool` when the trainer left none."""
    devices: dict[str, list[int]] = {}
    if "trainer" in needs:
        devices["trainer"] = pool[-needs["trainer"] :] if needs["trainer"] <= len(pool) else list(pool)
    engines_pool = [d for d in pool if d not in devices.get("trainer", [])] or pool
    turn = 0
    for name in (n for n in COMPONENTS if n in needs and n != "trainer"):
        count = needs[name]
        choices = engines_pool if count <= len(engines_pool) else pool
        if count > len(choices):
            raise ValueError(
                f"gpus.{name}: [{name}] needs {count} devices (SGLang: num_engines * tp * dp) and "
                f"{len(pool)} of the {num_devices} visible CUDA devices are there for it: use fewer "
                f"engines or make more devices visible"
            )
        devices[name] = [choices[(turn + i) % len(choices)] for i in range(count)]
        turn += count
    return devices


def _key(name: str, devices: Mapping[str, Sequence[int]], explicit: Mapping[str, Sequence[int]]) -> str:
    """`gpus.trainer = [0]`, marked as rl's choice when the user left the key unset."""
    suffix = "" if name in explicit else " (placed by rl)"
    return f"gpus.{name} = {list(devices[name])}{suffix}"


def check_devices(
    cfg: RunSections,
    devices: Mapping[str, Sequence[int]],
    explicit: Mapping[str, Sequence[int]],
    transport: str,
    num_devices: int | None = None,
) -> None:
    """Raise ValueError (one line naming both keys) for a placement that cannot run (module docstring).

    `num_devices` None: the machine is not known (config validation), device indices are not bounded."""
    for name, ds in devices.items():
        beyond = [d for d in ds if num_devices is not None and d >= num_devices]
        if beyond:
            raise ValueError(
                f"{_key(name, devices, explicit)} names device {beyond[0]}, and {num_devices} CUDA device(s) "
                f"are visible to rl (indices 0..{num_devices - 1}): use visible indices"
            )
    if "trainer" in devices:
        refusal = ranks_vs_devices(
            cfg.trainer.num_processes, len(devices["trainer"]), where=_key("trainer", devices, explicit)
        )
        if refusal:
            raise ValueError(refusal)
    for overlap in find_overlaps(devices):
        _check_overlap(overlap, devices, explicit, transport)
    if transport == shared_device_transport() and num_devices != 0:
        _check_shared_device(devices, explicit, transport)


def _check_overlap(
    overlap: Overlap,
    devices: Mapping[str, Sequence[int]],
    explicit: Mapping[str, Sequence[int]],
    transport: str,
) -> None:
    first, second = _key(overlap.first, devices, explicit), _key(overlap.second, devices, explicit)
    if overlap.first == overlap.second:
        raise ValueError(
            f"{first} names device {overlap.devices[0]} twice: each {overlap.first} rank or engine needs a "
            "device of its own; list distinct devices"
        )
    if transport == "distributed" and {overlap.first, overlap.second} == {"trainer", *WEIGHT_TAKERS}:
        raise ValueError(
            f"weights.transport = 'distributed' with {first} and {second} sharing device "
            f"{overlap.devices[0]}: NCCL refuses two ranks of one process group on one device ('Duplicate "
            "GPU detected'); give them separate devices, or leave weights.transport unset (rl then "
            "picks a path that works on one device)"
        )


def _check_shared_device(
    devices: Mapping[str, Sequence[int]], explicit: Mapping[str, Sequence[int]], transport: str
) -> None:
    """The shared-device path hands the trainer's tensors to engines on trainer rank 0's own device."""
    trainer = devices.get("trainer")
    for name in WEIGHT_TAKERS:
        if name in devices and trainer and set(devices[name]) != {trainer[0]}:
            raise ValueError(
                f"weights.transport = {transport!r} with {_key(name, devices, explicit)} and "
                f"{_key('trainer', devices, explicit)}: the shared-device path hands the trainer's tensors "
                f"to engines on trainer rank 0's device ({trainer[0]}) only; put the engines there or set "
                "weights.transport = 'filesystem' or 'distributed'"
            )


def chosen_transport(cfg: RunSections, devices: Mapping[str, Sequence[int]]) -> str:
    """`weights.transport` as given; left at its default with one trainer rank and the inference engine
    on one device, the shared-device path when this run can take it (`shared_run`), else the default
    (filesystem, which works on one device too)."""
    if "transport" in cfg.weights.model_fields_set or "trainer" not in devices:
        return cfg.weights.transport
    trainer = devices["trainer"]
    takers = [set(devices[name]) for name in WEIGHT_TAKERS if name in devices]
    if takers and len(trainer) == 1 and all(t == set(trainer) for t in takers) and shared_run(cfg):
        return SHARED_TRANSPORT
    return cfg.weights.transport


def shared_run(cfg: RunSections) -> RunSections | None:
    """`cfg` on the shared-device weight path with its device shares stated (`use_shared_weights`), or
    None when the schema has no such path or this run cannot take it (e.g. SGLang)."""
    if shared_device_transport() is None:
        return None
    try:
        return use_shared_weights(cfg)
    except ValueError:
        return None


def check_config(cfg: RunSections) -> None:
    """Config validation (`rl --dry-run` too): the explicit `[gpus]` lists, before the machine is known."""
    if cfg.inference.sglang.gpu_ids is not None:
        raise ValueError(
            f"inference.sglang.gpu_ids = {cfg.inference.sglang.gpu_ids} under rl: rl places every process "
            f"now; set gpus.inference = {cfg.inference.sglang.gpu_ids} instead (docs/gpu.md)"
        )
    needs = device_needs(cfg)
    explicit = explicit_devices(cfg)
    for name, listed in explicit.items():
        _check_list_length(cfg, name, listed, needs.get(name, 0))
    check_devices(cfg, explicit, explicit, cfg.weights.transport)


def _check_list_length(cfg: RunSections, name: str, listed: Sequence[int], needed: int) -> None:
    if name != "trainer" and name not in engine_sections(cfg):
        raise ValueError(f"gpus.{name} = {list(listed)} without [{name}]: remove it or configure [{name}]")
    if name == "trainer" and len(listed) < needed:
        refusal = ranks_vs_devices(needed, len(listed), where=f"gpus.trainer = {list(listed)}")
        raise ValueError(refusal)
    if len(listed) != needed:
        what = (
            "trainer.num_processes"
            if name == "trainer"
            else f"{name}.sglang.num_engines * tp * dp"
            if getattr(cfg, name).backend == "sglang"
            else f"the embedded engine of [{name}] (engine.device = {getattr(cfg, name).engine.device!r})"
        )
        raise ValueError(
            f"gpus.{name} = {list(listed)} holds {len(listed)} device(s) and {what} needs {needed}: list "
            "exactly the devices it uses"
        )


def engine_sections(cfg: RunSections) -> list[str]:
    """The engine sections this run has (inference always; eval and teacher engines when configured)."""
    return [name for name in COMPONENTS[:-1] if getattr(cfg, name) is not None]


def place(cfg: RunSections, num_devices: int) -> Placement:
    """The run's placement on a machine with `num_devices` visible CUDA devices (0: none, a no-op)."""
    if num_devices == 0:
        return Placement(devices={}, transport=cfg.weights.transport)
    explicit = explicit_devices(cfg)
    devices = assign_devices(device_needs(cfg), explicit, num_devices)
    transport = chosen_transport(cfg, devices)
    check_devices(cfg, devices, explicit, transport, num_devices)
    return Placement(devices=devices, transport=transport)


def child_visible_devices(parent: str | None, indices: Sequence[int]) -> str:
    """`CUDA_VISIBLE_DEVICES` for a child that should see `indices` of the devices its parent sees.

    The variable is not relative: a child's value replaces its parent's, so indices are translated
    through the parent's list (numbers, UUIDs or MIG ids) when it has one; an empty one hides every
    device, and stays hiding them (no index fits it)."""
    if parent is None:
        return ",".join(str(i) for i in indices)
    visible = [entry.strip() for entry in parent.split(",") if entry.strip()]
    missing = [i for i in indices if i >= len(visible)]
    if missing:
        raise ValueError(
            f"device index {missing[0]} is not among the {len(visible)} devices of CUDA_VISIBLE_DEVICES = "
            f"{parent!r}: use indices 0..{len(visible) - 1}"
        )
    return ",".join(visible[i] for i in indices)
