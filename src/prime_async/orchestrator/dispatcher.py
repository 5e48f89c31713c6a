"""Dispatcher: creates groups when admission allows, runs their episodes, hands finished groups to the sink.

    DataSource ──next_example──► Dispatcher ──(AdmissionController: hold / K / buffer / in-flight)──►
        group_size episode tasks ──RolloutSource.run_episode──► Group ──put──► TrainSink

Who calls it: `orchestrator.py` starts `run()` as a supervised task; the weight watcher calls
`cancel_unshippable()`, `admission.hold()/release()` and `wait_idle()`; the sink reports every group move
back through the `SinkListener` methods implemented here (ledger, admission, retry).

Invariants:
- a group is stamped with `admission.served_version` at creation; each episode's span is
  `(dispatch_version, version live when it finished)`, the latter being the served version or the
  newest per-token version the engine reported, whichever is larger;
- a group is created only when `admission.poll()` allows it, and admission is re-polled after every
  capacity change (episode/group finished, group dropped, batch cut, version change, release);
- `cancel_unshippable()` cancels exactly the in-flight groups with `next_batch_step - d > K`, and the
  accounting of a cancel (ledger, admission, sink, retry) happens synchronously inside the call;
- every dispatched episode is moved out of the ledger's `inflight` bucket exactly once;
- an exception escaping a RolloutSource (a bug: env faults come back as status "error") fails `run()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.ledger import Ledger
from prime_async.orchestrator.train_sink import DropReason, TrainSink
from prime_async.orchestrator.types import Episode, Group, PolicySpan, RolloutSource

logger = logging.getLogger(__name__)

_DROP_BUCKET = {"stale": "dropped_stale", "filtered": "filtered", "errored": "errored"}


@dataclass
class _InFlight:
    group: Group
    task: asyncio.Task | None = None
    unfinished: int = 0
    cancelled: bool = False


class Dispatcher:
    """Runs groups of `group_size` episodes of the rollout source under admission control."""

    def __init__(
        self,
        *,
        source: RolloutSource,
        data: DataSource,
        admission: AdmissionController,
        ledger: Ledger,
        group_size: int,
        sampling: dict[str, Any],
        retry_unused: bool,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.source = source
        self.data = data
        self.admission = admission
        self.ledger = ledger
        self.group_size = group_size
        self.sampling = sampling
        self.retry_unused = retry_unused
        self.clock = clock
        self.sink: TrainSink | None = None
        self._inflight: dict[int, _InFlight] = {}
        self._next_group_id = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._failure: BaseException | None = None
        self._window = {"cancelled_groups": 0, "completion_tokens": 0, "episodes": 0}
        self._window_start = clock()
        self.cancelled_group_ids: list[int] = []

    def attach_sink(self, sink: TrainSink) -> None:
        self.sink = sink

    # -- main loop -------------------------------------------------------------------------------------
    async def run(self) -> None:
        assert self.sink is not None, "attach_sink() before run()"
        while True:
            if self._failure is not None:
                raise self._failure
            if self.admission.poll() is not None:
                self.admission.changed.clear()
                await self.admission.changed.wait()
                continue
            self._dispatch_group()

    def _dispatch_group(self) -> None:
        example_id, epoch = self.data.next_example()
        group = Group(
            group_id=self._next_group_id,
            example_id=example_id,
            dispatch_version=self.admission.served_version,
            dispatched_at=self.clock(),
            epoch=epoch,
        )
        self._next_group_id += 1
        state = _InFlight(group=group, unfinished=self.group_size)
        self._inflight[group.group_id] = state
        self._idle.clear()
        self.ledger.dispatch(self.group_size)
        self.admission.on_group_dispatched()
        self.sink.on_dispatch(group)
        state.task = asyncio.create_task(self._run_group(state), name=f"group-{group.group_id}")

    async def _run_group(self, state: _InFlight) -> None:
        group = state.group
        try:
            episodes = await asyncio.gather(*(self._run_episode(state, i) for i in range(self.group_size)))
        except asyncio.CancelledError:
            if not state.cancelled:  # shutdown, not a cancel of ours: nothing to account
                raise
            return
        except Exception as exc:  # a RolloutSource bug: fail the run through run()
            logger.exception("episode of group %d raised", group.group_id)
            self._fail(exc)
            return
        group.episodes = list(episodes)
        group.finished_at = self.clock()
        del self._inflight[group.group_id]
        self._set_idle_if_empty()
        self.admission.on_group_returned()
        try:
            self.sink.put(group)
        except (
            Exception
        ) as exc:  # e.g. max_dropped_groups_per_step: nobody awaits this task, so hand it to run()
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.admission.notify()

    async def _run_episode(self, state: _InFlight, index: int) -> Episode:
        group = state.group
        ep = await self.source.run_episode(
            example_id=group.example_id, engine_key=f"g{group.group_id}-e{index}", sampling=self.sampling
        )
        # An engine may already serve N while `served_version` still says N-1 (mid-update): the
        # per-token versions it reports are the better witness of the version live at the finish.
        sampled = [v for v, m in zip(ep.token_versions, ep.loss_mask, strict=False) if m and v >= 0]
        end = max(self.admission.served_version, group.dispatch_version, max(sampled, default=-1))
        ep.span = PolicySpan(group.dispatch_version, end)
        if not state.cancelled:
            state.unfinished -= 1
            self._window["episodes"] += 1
            self._window["completion_tokens"] += ep.num_completion_tokens
            self.admission.on_episodes_finished(1)
        return ep

    # -- cancel / drain --------------------------------------------------------------------------------
    def cancel_unshippable(self) -> list[int]:
        """Cancel every in-flight group that can no longer be trained; return their ids."""
        doomed = [s for s in self._inflight.values() if not self.admission.can_ship(s.group.dispatch_version)]
        for state in doomed:
            self._cancel(state)
        return [s.group.group_id for s in doomed]

    def _cancel(self, state: _InFlight) -> None:
        group = state.group
        state.cancelled = True
        assert state.task is not None
        state.task.cancel()
        del self._inflight[group.group_id]
        self._set_idle_if_empty()
        self.ledger.move(self.group_size, "inflight", "cancelled")
        self.admission.on_episodes_finished(state.unfinished)
        self.admission.on_group_returned()
        self.sink.on_discard(group)
        self._window["cancelled_groups"] += 1
        self.cancelled_group_ids.append(group.group_id)
        if self.retry_unused:
            self.data.retry(group.example_id, group.epoch)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _set_idle_if_empty(self) -> None:
        if not self._inflight:
            self._idle.set()

    async def stop(self) -> None:
        tasks = [s.task for s in self._inflight.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- SinkListener ----------------------------------------------------------------------------------
    def on_accepted(self, group: Group, *, num_filtered_episodes: int) -> None:
        self.ledger.move(len(group.episodes), "inflight", "buffered")
        self.ledger.move(num_filtered_episodes, "inflight", "filtered")

    def on_dropped(self, group: Group, *, reason: DropReason, retry: bool, from_queue: bool) -> None:
        bucket = _DROP_BUCKET[reason]
        if from_queue:
            self.ledger.move(len(group.episodes), "buffered", bucket)
        else:
            self.ledger.move(self.group_size, "inflight", bucket)
        if retry:
            self.data.retry(group.example_id, group.epoch)
        self.admission.notify()

    def on_trained(self, groups: list[Group], *, step: int) -> None:
        """Batch `step` was cut. Same synchronous block as the removal from the queue, so admission
        never sees the freed buffer space before it sees the new `next_batch_step`."""
        self.ledger.move(sum(len(g.episodes) for g in groups), "buffered", "trained")
        self.admission.on_batch_cut(step)
        self.cancel_unshippable()  # the cut made them unshippable: stop wasting compute

    # -- state / metrics -------------------------------------------------------------------------------
    @property
    def num_inflight_groups(self) -> int:
        return len(self._inflight)

    @property
    def num_inflight_episodes(self) -> int:
        return self.group_size * len(self._inflight)

    def pending_examples(self) -> list[tuple[int, int]]:
        return [(s.group.example_id, s.group.epoch) for s in self._inflight.values()]

    def window_metrics(self) -> dict[str, float]:
        now = self.clock()
        span = max(now - self._window_start, 1e-9)
        out = {
            "rollout/buffer/inflight_groups": float(len(self._inflight)),
            "rollout/cancelled_groups": float(self._window["cancelled_groups"]),
            "rollout/episodes": float(self._window["episodes"]),
            "rollout/tokens_per_s": self._window["completion_tokens"] / span,
        }
        self._window = dict.fromkeys(self._window, 0)
        self._window_start = now
        return out
