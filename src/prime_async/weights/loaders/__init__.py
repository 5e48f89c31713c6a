"""The orchestrator side of the weight transports: one `WeightLoader` per transport, one per file.

    build_control(cfg, signal) ──► ControlServer (bound, receiving) + the loader of `cfg`:
        LoraLoader         (`lora` set: adapters from the broadcast directory)
        FilesystemLoader   (weights.transport = "filesystem")
        DistributedLoader  ("distributed")
        SharedLoader       ("shared")

Adding a transport: one file here (a `WeightLoader`), one entry in `LOADERS`, one value of
`WeightTransport` (`prime_async/types.py`), and its publisher in `weights/publishers/`.

Invariants: a `Published` event of another transport than `cfg.weights.transport` fails the run (the
two sides disagree); otherwise it reaches the loader, then wakes the watcher; a channel failure fails it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from prime_async.types import WeightTransport
from prime_async.weights.broadcasts import BroadcastDir, Broadcasts
from prime_async.weights.control import ControlServer, Published
from prime_async.weights.loaders.base import KEEP_ANNOUNCED, VersionGone, WeightLoader
from prime_async.weights.loaders.distributed import DistributedLoader
from prime_async.weights.loaders.filesystem import FilesystemLoader
from prime_async.weights.loaders.lora import LoraLoader
from prime_async.weights.loaders.shared import SharedLoader
from prime_async.weights.probe import ProbeReference

if TYPE_CHECKING:
    from prime_async.config.orchestrator import OrchestratorConfig

__all__ = ["LOADERS", "VersionGone", "WeightLoader", "broadcast_loader", "build_control", "build_loader"]


class Wakeup(Protocol):
    """What the loader's announcements wake (the watcher's `UpdateSignal`)."""

    def announce(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...


def broadcast_loader(broadcasts: Broadcasts, *, lora: bool) -> WeightLoader:
    """The loader of versions in the broadcast directory: LoRA adapters, or full weights."""
    return LoraLoader(broadcasts) if lora else FilesystemLoader(broadcasts)


def _filesystem(cfg: OrchestratorConfig, control: ControlServer, keep: int) -> WeightLoader:
    return broadcast_loader(BroadcastDir(cfg.output_dir / "broadcasts"), lora=cfg.inference.lora is not None)


LOADERS: dict[WeightTransport, Callable[[OrchestratorConfig, ControlServer, int], WeightLoader]] = {
    "filesystem": _filesystem,
    "distributed": lambda cfg, control, keep: DistributedLoader(control, cfg.weights, keep_announced=keep),
    "shared": lambda cfg, control, keep: SharedLoader(control, cfg.weights, keep_announced=keep),
}


def build_loader(cfg: OrchestratorConfig, control: ControlServer) -> WeightLoader:
    """The loader of `cfg.weights.transport`; it remembers enough announcements for the run (a
    deterministic run loads every version in turn: K + 2)."""
    keep = KEEP_ANNOUNCED if not cfg.deterministic else max(KEEP_ANNOUNCED, cfg.max_off_policy_steps + 2)
    return LOADERS[cfg.weights.transport](cfg, control, keep)


def build_control(
    cfg: OrchestratorConfig, signal: Wakeup, on_probe: Callable[[int, ProbeReference], None] | None = None
) -> tuple[ControlServer, WeightLoader]:
    """The control channel (bound and receiving) and the loader of `cfg`. A `Published` event announces
    on `signal`, a channel failure fails it: the weight watcher built with the same `signal` wakes, or
    raises. `on_probe` gets the weight probe's reference an announcement carries (`weights/probe.py`)."""
    loader: WeightLoader | None = None

    def on_published(msg: Published) -> None:
        if msg.transport != cfg.weights.transport:
            raise RuntimeError(
                f"the trainer publishes weights over {msg.transport!r} but this orchestrator has "
                f"weights.transport = {cfg.weights.transport!r}: set weights.transport alike everywhere"
            )
        assert loader is not None
        if on_probe is not None and msg.probe is not None:
            on_probe(msg.version, msg.probe)
        loader.on_published(msg)
        signal.announce()

    port = cfg.weights.resolved_control_port(cfg.transport)
    control = ControlServer(
        cfg.transport.host, port, on_published=on_published, on_error=signal.fail, transport=cfg.transport
    )
    loader = build_loader(cfg, control)
    control.start()
    return control, loader
