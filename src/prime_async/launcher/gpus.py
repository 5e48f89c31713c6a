"""GPU placement at `rl` start: count the visible CUDA devices, place the run, set each process's devices.

Called by `launcher/rl.py` after `resolve_run` and before the ports are checked (the weight transport
chosen here decides whether the weight group's rendezvous port is bound) and before the sub-configs are
written. The rules are pure (`config/placement.py`); this module adds the machine and the environment.

Invariants:
- with no visible CUDA device nothing changes: no process gets CUDA_VISIBLE_DEVICES from `rl`;
- otherwise every component that needs devices is started with CUDA_VISIBLE_DEVICES naming exactly its
  devices (translated through `rl`'s own CUDA_VISIBLE_DEVICES), so inside it they are cuda:0..n-1; the
  orchestrator, which needs none, inherits `rl`'s environment;
- a placement that cannot run is a ValueError of one line (the CLI prints it and exits 2) raised before
  any process of the run exists.
"""

from __future__ import annotations

import logging

from prime_async.config.placement import (
    Placement,
    child_visible_devices,
    explicit_devices,
    find_overlaps,
    place,
    shared_run,
)
from prime_async.config.rl import RLConfig

logger = logging.getLogger(__name__)


def visible_cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA); the only place `rl` asks the machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_run(cfg: RLConfig, num_devices: int | None = None) -> tuple[RLConfig, Placement]:
    """`cfg` (with the weight transport the placement chose) and its placement on this machine."""
    num_devices = visible_cuda_devices() if num_devices is None else num_devices
    placement = place(cfg, num_devices)
    if num_devices == 0:
        if explicit_devices(cfg):
            logger.warning("no CUDA device is visible: [gpus] is ignored, every component runs on the CPU")
        return cfg, placement
    if placement.transport != cfg.weights.transport:
        shared = shared_run(cfg)
        assert shared is not None and shared.weights.transport == placement.transport
        cfg = shared
        logger.info(
            "trainer and engine share device %s: weights.transport = %r (left unset), device shares "
            "trainer.runtime.mem_fraction = %s, inference.engine.mem_fraction = %s",
            placement.devices["trainer"][0], cfg.weights.transport, cfg.trainer.runtime.mem_fraction,
            cfg.inference.engine.mem_fraction,
        )  # fmt: skip
    shared = [f"{o.first} and {o.second} share {list(o.devices)}" for o in find_overlaps(placement.devices)]
    logger.info(
        "placement on %d CUDA device(s): %s%s", num_devices,
        ", ".join(f"{name} {devices}" for name, devices in placement.devices.items()),
        f" ({'; '.join(shared)})" if shared else "",
    )  # fmt: skip
    return cfg, placement


def component_env(base: dict[str, str], placement: Placement, name: str) -> dict[str, str]:
    """The environment of component `name`: `base` (rl's own, with its CUDA_VISIBLE_DEVICES) plus the
    component's CUDA_VISIBLE_DEVICES when it is placed."""
    if name not in placement.devices:
        return dict(base)
    visible = child_visible_devices(base.get("CUDA_VISIBLE_DEVICES"), placement.devices[name])
    return {**base, "CUDA_VISIBLE_DEVICES": visible}
