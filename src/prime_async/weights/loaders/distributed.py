"""Orchestrator side of `weights.transport = "distributed"`: the weight process group and one version's
transfer.

    join (first load, and after an engine outage):
      /destroy_weights_update_group(old name) on every engine (best effort)
      JoinGroup(master, world = 1 + engines, name) ──► trainer rank 0   ┐ concurrently: the group forms
      /init_weights_update_group(rank_offset = 1 + i) ──► engine i       ┘ when all ranks arrived
    load(version) (the watcher has cancelled, paused or drained already):
      SendWeights(version) ──► trainer ── ack: it holds the version
      /begin_weight_update on every engine (SGLang 0.5.23 receives only inside this session)
      for each bucket of Published(version): /update_weights_from_distributed(names, dtypes, shapes) on
        every engine, concurrently with the trainer's broadcasts; the last bucket carries
        `weight_version` and `flush_cache`
      /end_weight_update on every engine; trainer ── done

Invariants: only versions the trainer announced (`Published`) are loaded, with the buckets it announced;
a version's label reaches an engine only with its last bucket, so an engine labelled N holds all of N;
each join uses a fresh group name, so no engine or trainer ever mixes ranks of two incarnations.
The group needs one rank per engine: every engine must be the embedded engine or SGLang with tp 1.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import uuid
from collections.abc import Sequence
from typing import Any

from prime_async.config.shared import WeightsConfig
from prime_async.weights.control import (
    VERSION_GONE,
    ControlServer,
    JoinGroup,
    Published,
    Refused,
    SendWeights,
)
from prime_async.weights.loaders.base import KEEP_ANNOUNCED, Announced, VersionGone
from prime_async.weights.tensor_meta import TensorMeta

logger = logging.getLogger(__name__)


class DistributedLoader:
    """`WeightLoader` over a torch.distributed group trainer rank 0 + every engine."""

    def __init__(self, control: ControlServer, cfg: WeightsConfig, *, keep_announced: int = KEEP_ANNOUNCED):
        self.control, self.cfg = control, cfg
        self.keep_announced = keep_announced
        self._announced: Announced[list[list[TensorMeta]]] = Announced(keep_announced)
        self._group: str | None = None
        self._retired: list[str] = []  # groups to leave on the engines before the next join

    def on_published(self, msg: Published) -> None:
        self._announced.add(msg.version, msg.buckets)

    def latest(self) -> int | None:
        return self._announced.latest()

    def engines_restarted(self) -> bool:
        """An engine outage: the group is rebuilt before the next load (a restarted engine rejoins with
        the initial model, so it is given the run's weights first)."""
        self._retire()
        return True

    def _retire(self) -> None:
        if self._group is not None:
            self._retired.append(self._group)
        self._group = None

    async def load(self, engines: Sequence[Any], version: int, *, flush_cache: bool) -> None:
        buckets = self._announced.get(version)
        if self._group is None:
            await self._join(engines)
        assert self._group is not None
        request = self.control.open_request(lambda rid: SendWeights(rid, version, self._group or ""))
        try:
            try:
                await request.reply("ack", self.cfg.timeout_s)  # a refusal here leaves the group untouched
            except Refused as e:
                if VERSION_GONE in str(e):
                    raise VersionGone(str(e)) from e
                raise
            try:
                await self._transfer(engines, buckets, version, flush_cache)
                await request.reply("done", self.cfg.timeout_s)
            except BaseException:
                self._retire()  # a transfer cut short leaves the group in an unknown state: rebuild it
                raise
        finally:
            request.close()

    async def _transfer(
        self, engines: Sequence[Any], buckets: list[list[TensorMeta]], version: int, flush_cache: bool
    ) -> None:
        await asyncio.gather(*(e.begin_weight_update() for e in engines))  # SGLang's update session
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            await asyncio.gather(
                *(self._receive(e, bucket, version if last else None, flush_cache and last) for e in engines)
            )
        await asyncio.gather(*(e.end_weight_update() for e in engines))

    async def _receive(self, engine: Any, bucket: list[TensorMeta], version: int | None, flush: bool) -> None:
        await engine.update_weights_from_distributed(
            names=[m.name for m in bucket],
            dtypes=[m.dtype for m in bucket],
            shapes=[m.shape for m in bucket],
            group_name=self._group,
            weight_version=version,
            flush_cache=flush,
        )

    async def _join(self, engines: Sequence[Any]) -> None:
        await self.control.wait_trainer(self.cfg.timeout_s)
        for old in self._retired:  # best effort: a restarted engine no longer has it (answers False)
            await asyncio.gather(
                *(e.destroy_weights_update_group(old) for e in engines), return_exceptions=True
            )
        self._retired.clear()
        backend = self.cfg.backend
        if backend == "auto":
            backend = "nccl" if self.control.trainer_device == "cuda" else "gloo"
        name = f"prime-async-weights-{uuid.uuid4().hex[:8]}"
        world = 1 + len(engines)
        address, port = (
            self.cfg.master_address,
            _rendezvous_port(self.cfg.master_address, self.cfg.master_port),
        )
        logger.info("building weight process group %s: trainer + %d engine(s), %s on %s:%d", name,
                    len(engines), backend, address, port)  # fmt: skip
        request = self.control.open_request(lambda rid: JoinGroup(rid, address, port, world, name, backend))
        try:
            await asyncio.gather(
                request.reply("done", self.cfg.timeout_s),
                *(
                    e.init_weights_update_group(
                        master_address=address,
                        master_port=port,
                        rank_offset=1 + i,
                        world_size=world,
                        group_name=name,
                        backend=backend,
                    )
                    for i, e in enumerate(engines)
                ),
            )
        finally:
            request.close()
        self._group = name


def _rendezvous_port(address: str, port: int) -> int:
    """`port`, or a free port on `address` when `address` is on this host and something already listens
    on `port`: a port picked at launch (`master_port = 0`) can be handed to another socket of the run by
    the time the group forms (seen: the gateway's HTTP server), and a rejoin after an outage needs a port
    the old rendezvous may still hold. A remote `address` cannot be probed from here and is used as is."""
    with socket.socket() as probe:
        try:
            probe.bind((address, port))
            return port
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return port  # not an address of this host: trainer rank 0 is on another node
    with socket.socket() as probe:
        probe.bind((address, 0))
        fresh = probe.getsockname()[1]
    logger.warning(
        "weights.master_port %d on %s is in use; the weight process group meets on port %d",
        port,
        address,
        fresh,
    )
    return fresh
