"""Dispatcher: creates groups when admission allows, runs their episodes, hands finished groups to the sink.

    EnvMix ──next_prompt──► Dispatcher ──(AdmissionController: hold / K / buffer / in-flight)──►
        group_size episode tasks ──(the group's env) RolloutSource.run_episode──► Group ──put──► Sink

Who calls it: `orchestrator.py` starts `run()` as a supervised task and `stop()` at shutdown. Where each
group is (in flight, buffered, ended) is the group table's (`groups.py`): the dispatcher reports every
dispatch, finished episode and finished group to it, and the sink decides the rest.

Invariants:
- a group is stamped with `admission.served_version` at creation; each episode's span is
  `(dispatch_version, version live when it finished)`, the latter being the served version or the
  newest per-token version the engine reported, whichever is larger;
- a group is stamped with the environment its prompt came from (`Group.env`, chosen by the mix's
  schedule) and all its episodes run on that environment's source with its sampling settings;
- a group is created only when `admission.poll()` allows it, and admission is re-polled after every
  capacity change (the `changed` event of the group table);
- an episode that finishes after its group was cancelled (`GroupTable.cancel_unshippable`) counts
  nowhere: no slot, no metric, no error record;
- an exception escaping a RolloutSource (a bug: env faults come back as status "error") fails `run()`;
- a finished group holds every trajectory of its episodes (several per episode for a multi-agent env),
  reported with `groups.finish` before the sink sees the group; a sink that leaves it in flight fails
  `run()`;
- idle trajectories (`status="idle"`: a seat of a multi-agent episode that never acted, no token) are
  counted (`rollout/idle_trajectories`) and removed before the sink sees the group: the sink, per-seat
  advantages and the packer only ever see trajectories that acted. The group table counted them at
  `finish`, so `accept` ends them as filtered; a group left with none is dropped as filtered here;
- every failed episode is recorded in `errors` (logged once per distinct error), a teacher scoring
  failure too (kind "teacher", recorded after scoring); a fatal error of the sink (dropped-groups
  limit) is re-raised with the most frequent episode error appended, and when every episode of the
  first `fail_fast_groups` finished groups failed, `run()` fails at once with it; both say "teacher"
  instead of blaming the environment when that error is the teacher's;
  a prompt that does not fit `seq_len` (`prompt_too_long`) within those first groups fails `run()` at
  the first such episode, naming the env (a config mismatch, not bad luck);
- with a deterministic schedule (`schedule.py`), a group's id is its schedule slot and each episode
  samples with `sampling.seed = episode_seed(run seed, env, example, epoch, index in the group)`;
- the length bias (`length_bias.py`) sees every finished group once, after the sink's put (its
  trajectories before the put, and whether the sink accepted it), and every cancelled group once (its
  finished trajectories and what its running ones had sampled);
- with a teacher (on-policy distillation), a group's episodes are scored (`teacher.py`) before the group
  is finished, so batch cuts only ever see scored groups; during a teacher outage the group stays in
  flight until scored, and an outage past `teacher.outage_timeout_s` fails `run()` (TeacherUnavailable);
- a resumed run's prompt with carried work (`carry.py`) is dispatched with the dispatch version it had:
  its finished episodes are reused as they are and its unfinished ones replay their recorded calls;
  unless the batch it would land in (`groups.landing_batch()`) is past that version's K, in which case
  the carried work is discarded and the prompt starts afresh at the served version (never cancelled
  later for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.carry import Carry
from prime_async.orchestrator.env_mix import EnvMix
from prime_async.orchestrator.episode_log import EpisodeLog
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.length_bias import LengthBias
from prime_async.orchestrator.schedule import DeterministicSchedule
from prime_async.orchestrator.train_sink import Sink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.episode_errors import TEACHER, EpisodeErrors, EpisodesFailing
from prime_async.rollouts.seeds import episode_seed
from prime_async.rollouts.teacher import TeacherScorer, TeacherUnavailable
from prime_async.rollouts.types import Episode, PolicySpan

logger = logging.getLogger(__name__)


def episode_key(group: Group, index: int) -> str:
    """The engine key (sticky routing, and how a running episode's recorded calls are found) of the
    `index`-th episode of `group`."""
    return f"g{group.group_id}-e{index}"


class Dispatcher:
    """Runs groups of `group_size` episodes of the mix's environments under admission control."""

    def __init__(
        self,
        *,
        envs: EnvMix,
        admission: AdmissionController,
        groups: GroupTable,
        sink: Sink,
        clock: Callable[[], float] = time.monotonic,
        fail_fast_groups: int = 2,
        schedule: DeterministicSchedule | None = None,
        teacher: TeacherScorer | None = None,
        episode_log: EpisodeLog | None = None,
        carry: Carry | None = None,
        length_bias: LengthBias | None = None,
    ):
        self.envs = envs
        self.admission = admission
        self.groups = groups
        self.sink = sink
        self.clock = clock
        self._next_group_id = 0
        self._failure: BaseException | None = None
        self._window = {"completion_tokens": 0, "episodes": 0, "idle_trajectories": 0}
        self._window_start = clock()
        self.errors = EpisodeErrors()
        self.fail_fast_groups = fail_fast_groups
        self._finished_groups = 0
        self._failed_early_groups = 0
        self.schedule = schedule
        self.teacher = teacher
        self.episode_log = episode_log
        self.carry = carry
        self.length_bias = length_bias

    # -- main loop -------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if self._failure is not None:
                raise self._failure
            if self.admission.poll() is not None:
                self.admission.changed.clear()
                await self.admission.changed.wait()
                continue
            self._dispatch_group()

    def _dispatch_group(self) -> None:
        env, example_id, epoch = self.envs.next_prompt()
        if self.schedule is not None:
            self._next_group_id = self.schedule.take_slot()
        carried = self.carry.take(env.name, example_id, epoch) if self.carry is not None else None
        if carried is not None and self.groups.landing_batch() > self.groups.deadline_of(
            carried.dispatch_version
        ):
            carried = None  # its version could not ship in the batch it lands in: the prompt starts afresh
        group = Group(
            group_id=self._next_group_id,
            example_id=example_id,
            dispatch_version=self.admission.served_version if carried is None else carried.dispatch_version,
            dispatched_at=self.clock(),
            epoch=epoch,
            env=env.name,
            carried=carried,
        )
        self._next_group_id += 1
        task = asyncio.create_task(self._run_group(group), name=f"group-{group.group_id}")
        self.groups.dispatch(group, task)

    async def _run_group(self, group: Group) -> None:
        try:
            episodes = (self._run_episode(group, i) for i in range(self.groups.group_size))
            results = await asyncio.gather(*episodes)
            if self.teacher is not None:  # before the group is finished: the cut never waits on it
                failed = await self.teacher.score([ep for trajectories in results for ep in trajectories])
                for ep in failed:  # recorded ok when they finished: now teacher errors
                    self.errors.record(ep)
        except asyncio.CancelledError:
            if self.groups.is_inflight(group.group_id):  # shutdown, not a cancel: nothing to account
                raise
            self._count_cancelled(group)
            return
        except TeacherUnavailable as exc:  # an outage past its deadline: the run fails with its one line
            self._fail(exc)
            return
        except Exception as exc:  # a RolloutSource bug: fail the run through run()
            logger.exception("episode of group %d raised", group.group_id)
            self._fail(exc)
            return
        group.episodes = [ep for trajectories in results for ep in trajectories]
        group.finished_at = self.clock()
        self.groups.finish(group)
        generated = list(group.episodes)  # the length bias: what the sink's filters may remove
        if self.episode_log is not None:
            self.episode_log.write_group(group)
        early_failure = self._check_early_failures(group)
        try:
            self._ship(group)
        except Exception as exc:  # e.g. max_dropped_groups_per_step: nobody awaits this task
            summary = self.errors.summary()
            if summary and self.errors.top_kind() == TEACHER:
                summary = f"the drops are teacher failures (orchestrator.teacher): {summary}"
            self._fail(RuntimeError(f"{exc}; {summary}") if summary else exc)
        if self.groups.is_inflight(group.group_id):
            self._fail(RuntimeError(f"the sink neither accepted nor dropped group {group.group_id}"))
        elif self.length_bias is not None:
            accepted = any(g is group for g in self.groups.buffered())
            self.length_bias.finished(group, generated, accepted=accepted)
        if early_failure is not None:
            self._fail(early_failure)

    def _ship(self, group: Group) -> None:
        """Hand `group` to the sink without its idle trajectories (module docstring); a group with no
        other trajectory is filtered (nothing to train, not an error) without reaching the sink."""
        idle = sum(ep.status == "idle" for ep in group.episodes)
        if idle:
            self._window["idle_trajectories"] += idle
            group.episodes = [ep for ep in group.episodes if ep.status != "idle"]
        if group.episodes:
            self.sink.put(group)
        else:
            self.groups.drop(group, "filtered")

    def _count_cancelled(self, group: Group) -> None:
        """Length bias of a cancelled group (in flight, or while the teacher scored it): its finished
        trajectories and what its running ones had sampled, taken from the env's rollout source
        (`take_cancelled_lengths`: one length per trajectory)."""
        if self.length_bias is None:
            return
        source = self.envs.get(group.env).source
        partial: list[int] = []
        for index in range(self.groups.group_size):
            partial.extend(source.take_cancelled_lengths(episode_key(group, index)))
        self.length_bias.cancelled_group(group, partial)

    def _check_early_failures(self, group: Group) -> EpisodesFailing | None:
        """The run's error when every episode of the first `fail_fast_groups` groups failed."""
        self._finished_groups += 1
        if self._finished_groups > self.fail_fast_groups:
            return None
        acted = [ep for ep in group.episodes if ep.status != "idle"]
        if acted and all(ep.status == "error" for ep in acted):
            self._failed_early_groups += 1
        if self._failed_early_groups < self.fail_fast_groups or self.fail_fast_groups == 0:
            return None
        culprit = (
            "the teacher cannot score these episodes as configured (orchestrator.teacher)"
            if self.errors.top_kind() == TEACHER
            else "the environment cannot run as configured"
        )
        return EpisodesFailing(
            f"every episode of the first {self.fail_fast_groups} groups failed "
            f"({self.errors.total} episodes): {self.errors.summary() or 'no error message'}; {culprit} "
            "(set orchestrator.fail_fast_groups = 0 to keep going anyway)"
        )

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.admission.notify()

    async def _run_episode(self, group: Group, index: int) -> list[Episode]:
        """One episode of the group: its trajectories (one, or one per trained seat)."""
        carried = group.carried
        if carried is not None and index in carried.done:  # finished in an earlier lifetime
            trajectories = carried.done[index]
            if self.carry is not None:
                self.carry.count_reused(trajectories)
        else:
            trajectories = await self._generate_episode(group, index)
        group.finished_by_index[index] = trajectories
        if self.groups.episode_done(group):
            self._window["episodes"] += 1
            self._window["completion_tokens"] += sum(ep.num_completion_tokens for ep in trajectories)
            for ep in trajectories:
                self.errors.record(ep)
                self._check_prompt_fits(group, ep)
        return trajectories

    async def _generate_episode(self, group: Group, index: int) -> list[Episode]:
        env = self.envs.get(group.env)
        sampling = env.sampling
        if self.schedule is not None:
            seed = episode_seed(self.schedule.seed, group.env, group.example_id, group.epoch, index)
            sampling = dataclasses.replace(sampling, seed=seed)
        replay = group.carried.calls.get(index) if group.carried is not None else None
        result = await env.source.run_episode(
            example_id=group.example_id, engine_key=episode_key(group, index), sampling=sampling,
            replay=replay or None,
        )  # fmt: skip
        trajectories = result if isinstance(result, list) else [result]
        if not trajectories:
            raise RuntimeError(f"rollout source returned no trajectory for example {group.example_id}")
        for ep in trajectories:
            # An engine may already serve N while `served_version` still says N-1 (mid-update): the
            # per-token versions it reports are the better witness of the version live at the finish.
            sampled = [v for v, m in zip(ep.token_versions, ep.loss_mask, strict=False) if m and v >= 0]
            end = max(self.admission.served_version, group.dispatch_version, max(sampled, default=-1))
            ep.span = PolicySpan(group.dispatch_version, end)
        return trajectories

    def _check_prompt_fits(self, group: Group, ep: Episode) -> None:
        if ep.metrics.get("env_error") != "prompt_too_long" or self.fail_fast_groups == 0:
            return
        if self._finished_groups < self.fail_fast_groups:
            self._fail(EpisodesFailing(
                f"env {group.env!r}, example {ep.example_id}: {ep.error.removeprefix('prompt_too_long: ')} "
                "(orchestrator.fail_fast_groups = 0 keeps going and drops such prompts)"
            ))  # fmt: skip

    async def stop(self) -> None:
        tasks = self.groups.tasks()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Episodes, completion tokens per second and idle trajectories since the last call (then reset)."""
        now = self.clock()
        span = max(now - self._window_start, 1e-9)
        out = {
            "rollout/episodes": float(self._window["episodes"]),
            "rollout/tokens_per_s": self._window["completion_tokens"] / span,
            "rollout/idle_trajectories": float(self._window["idle_trajectories"]),
        }
        self._window = dict.fromkeys(self._window, 0)
        self._window_start = now
        return out
