"""The trainer side of a weight transport: the `WeightPublisher` protocol and what its implementations share.

    Trainer.publish(n) ──► publisher.publish(Weights, n)   (rank 0; `build_publisher` picks the class)
    control thread     ──► publisher.answer(request, reply) (the orchestrator's requests, one at a time)

Every implementation (one file per transport in this package) makes a version available, then announces
it on the control channel (`Published`), and answers the control requests of its own transport; a
request of another transport is refused with a message naming the trainer's `weights.transport`.

Invariants: a version is announced only after it exists; a snapshot is a copy, never a view of
parameters that later optimizer steps change; `flush()` returns once every version published so far is
written and announced (and raises a failed write's error); `close()` ends the control channel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prime_async.config.trainer import TrainerConfig
from prime_async.types import WeightTransport
from prime_async.weights.control import ControlClient, ControlRequest, Published, Reply
from prime_async.weights.probe import ProbeReference
from prime_async.weights.writer import BroadcastWriter

logger = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 2  # the newest and the one the orchestrator may still be loading


@dataclass(frozen=True)
class Weights:
    """One version as the trainer hands it over: full HF tensors, or a LoRA adapter (its PEFT config
    in `adapter_config`, its tensors in PEFT file naming)."""

    tensors: dict[str, torch.Tensor]
    adapter_config: Any = None


class WeightPublisher(Protocol):
    """Trainer rank 0's end of one weight transport (see the module docstring for the invariants)."""

    last_write_s: float | None  # how long the last finished version took to write + announce

    def publish(self, weights: Weights, version: int, *, protected: Iterable[int], on_disk: bool) -> None:
        """Make `version` available and announce it. `on_disk`: a restart may load this version
        (checkpoint or last step); `protected`: versions the broadcast directory keeps."""
        ...

    def attach_probe(self, version: int, probe: ProbeReference) -> None:
        """`version`'s announcement carries `probe` (called before `publish(version)`)."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def snapshots_to_keep(cfg: TrainerConfig) -> int:
    """Versions held in memory for the distributed and shared transports. A deterministic run loads every
    version in turn and the trainer runs up to K + 1 versions ahead of the served one, so it keeps K + 1
    (that many copies of the weights: CPU, or the trainer's GPU for shared on CUDA); otherwise the
    orchestrator asks for the newest, and a version it asks for once two newer exist is refused and
    replaced by the newest (`WeightWatcher.update`)."""
    if cfg.deterministic:
        return max(KEEP_SNAPSHOTS, (cfg.max_off_policy_steps or 0) + 1)
    return KEEP_SNAPSHOTS


def snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of `state` (never a view: the optimizer changes the parameters while it is written)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def without_tied_head(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """`state` less `lm_head.weight` when the model ties it to the embedding (engines tie it)."""
    return {k: v for k, v in state.items() if k != "lm_head.weight"} if tied else state


class ControlledPublisher:
    """What every publisher shares: the broadcast writer, the control channel, and the request loop.
    Subclasses set `transport`, implement `publish`, and override `answer` for their own requests."""

    transport: WeightTransport

    def __init__(self, cfg: TrainerConfig, writer: BroadcastWriter, device: torch.device, *, tied: bool):
        self.cfg, self.writer, self.device, self.tied = cfg, writer, device, tied
        self.last_write_s: float | None = None
        self._probes: dict[int, ProbeReference] = {}  # attached, not yet announced
        port = cfg.weights.resolved_control_port(cfg.transport)
        self.control = ControlClient(
            cfg.transport.host, port, handler=self._handle, device=device.type, transport=cfg.transport
        )

    def attach_probe(self, version: int, probe: ProbeReference) -> None:
        self._probes[version] = probe

    def announce(self, version: int, **fields: Any) -> None:
        """Every transport announces here: the version's probe reference (if attached) travels with it."""
        probe = self._probes.pop(version, None)
        for old in [v for v in self._probes if v < version]:  # never announced (a failed write)
            del self._probes[old]
        self.control.publish(Published(version, self.transport, probe=probe, **fields))

    def flush(self) -> None:
        """Nothing is written in the background unless a subclass says so."""

    def close(self) -> None:
        self.control.close()

    def answer(self, msg: ControlRequest, reply: Callable[[Reply], None]) -> Reply | None:
        """Serve `msg` on the control thread (`reply` sends an early reply, e.g. SendWeights' "ack");
        return its "done" reply, or None for a plain success. The default refuses every request."""
        raise ValueError(f"{type(msg).__name__}: the trainer's weights.transport is {self.transport!r}")

    def _handle(self, msg: ControlRequest, reply: Callable[[Reply], None]) -> None:
        try:
            done = self.answer(msg, reply)
        except Exception as e:  # reported to the orchestrator, which fails the update loudly
            logger.exception("weight transfer request %s failed", type(msg).__name__)
            reply(Reply(msg.request_id, False, "done", f"{type(e).__name__}: {e}"))
            return
        reply(done if done is not None else Reply(msg.request_id, True, "done"))
