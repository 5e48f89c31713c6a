"""The parts one orchestrator lifetime runs with (`Components`, a plain record) and how they are built
from the config and what the lifetime was handed (`ComponentInputs` -> `build_components`).

Construction order has no cycle: env mix -> group table -> admission, sink -> dispatcher -> watcher;
every component that needs to know where a group is reads the one group table. `deterministic = true`
adds one shared `DeterministicSchedule` (`schedule.py`) to admission, the dispatcher, the sink
(`DeterministicSink`) and the watcher (version by version, `drain` updates).

Modules that act on a running orchestrator (the loop, the planned stop, the simulator) type against the
record without importing the loop, so the package keeps no import cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import EngineClient
from prime_async.eval.setup import merged_sampling
from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.carry import Carry
from prime_async.orchestrator.ckpt import latest_checkpoint
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.dispatcher import Dispatcher
from prime_async.orchestrator.engine_load import EngineLoad
from prime_async.orchestrator.env_mix import EnvMix, MixEnv
from prime_async.orchestrator.episode_log import EpisodeLog
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.length_bias import LengthBias
from prime_async.orchestrator.schedule import DeterministicSchedule
from prime_async.orchestrator.train_sink import Sink, build_train_sink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.teacher import TeacherScorer
from prime_async.rollouts.types import RolloutSource
from prime_async.utils.stall import StallWatch
from prime_async.weights.loaders.base import WeightLoader
from prime_async.weights.probe_check import WeightProbe
from prime_async.weights.request_gate import RequestGate
from prime_async.weights.watcher import UpdateSignal, WeightWatcher
from prime_async.weights.watcher_peers import WatcherSettings

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """Everything `run_loop` drives; `start_step` is the first step this lifetime cuts."""

    envs: EnvMix
    groups: GroupTable
    admission: AdmissionController
    dispatcher: Dispatcher
    sink: Sink
    watcher: WeightWatcher
    start_step: int = 0
    teacher: TeacherScorer | None = None
    engine_load: EngineLoad | None = None
    carry: Carry | None = None
    length_bias: LengthBias = field(default_factory=LengthBias)
    undelivered: dict[int, list[Group]] = field(default_factory=dict)
    """Groups of each batch cut in this lifetime that not every trainer rank has fetched yet."""


@dataclass
class ComponentInputs:
    """What a lifetime hands `build_components` besides the config: the started rollout sources and
    engines, and the pieces built before the components (`main._start`).

    `source` is the rollout source of each training env by name (a single source serves a one-env run);
    `loader` is where versions come from and how they reach the engines (`weights/loaders/`);
    `request_gate` is the one gate every gateway in front of the training engines passes, `signal` what
    the control channel wakes the watcher with; all three are given to the watcher."""

    source: RolloutSource | Mapping[str, RolloutSource]
    engines: Sequence[EngineClient]
    loader: WeightLoader
    served_version: int
    clock: Callable[[], float] = time.monotonic
    request_gate: RequestGate | None = None
    stalls: StallWatch | None = None
    signal: UpdateSignal | None = None
    teacher: TeacherScorer | None = None
    episode_log: EpisodeLog | None = None
    probe: WeightProbe | None = None


def build_env_mix(cfg: OrchestratorConfig, sources: Mapping[str, RolloutSource]) -> EnvMix:
    """The training environments of `cfg.envs` over their (started) sources, keyed by env name."""
    envs = []
    for env_cfg in cfg.envs:
        source = sources[env_cfg.label]
        data = DataSource(num_examples=source.num_examples, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        sampling = merged_sampling(cfg.sampling, env_cfg.sampling)
        envs.append(MixEnv(env_cfg.label, source, data, sampling, ratio=env_cfg.ratio))
    return EnvMix(envs)


def build_components(cfg: OrchestratorConfig, inputs: ComponentInputs) -> Components:
    """Build every component from `cfg`; restore the data positions and the mix when resuming
    (`cfg.data.ckpt.resume`)."""
    source = inputs.source
    if not isinstance(source, Mapping):
        source = {env.label: source for env in cfg.envs}
    envs = build_env_mix(cfg, source)
    start_step, saved = _restore(cfg, envs)
    carry = None
    if saved.get("carry") and not cfg.deterministic:
        carry = Carry(saved["carry"], served_version=inputs.served_version)
    groups = _group_table(cfg, envs, start_step)
    schedule = _schedule(cfg, start_step)
    admission = AdmissionController(
        groups=groups,
        max_inflight_groups=cfg.resolved_max_inflight_groups,
        max_buffered_groups=cfg.resolved_max_buffered_groups,
        granularity=cfg.admission.submission_granularity,
        served_version=inputs.served_version,
        clock=inputs.clock,
        schedule=schedule,
    )
    sink = build_train_sink(
        cfg=cfg.batch.sink,
        schedule=schedule,
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        seq_len=cfg.seq_len,
        groups=groups,
    )
    length_bias = LengthBias()
    dispatcher = Dispatcher(
        envs=envs, admission=admission, groups=groups, sink=sink, clock=inputs.clock,
        fail_fast_groups=cfg.admission.fail_fast_groups, schedule=schedule, teacher=inputs.teacher,
        episode_log=inputs.episode_log, carry=carry, length_bias=length_bias,
    )  # fmt: skip
    watcher = _watcher(cfg, inputs, admission, groups, schedule)
    return Components(
        envs, groups, admission, dispatcher, sink, watcher, start_step, inputs.teacher,
        EngineLoad(inputs.engines), carry, length_bias,
    )  # fmt: skip


def _group_table(cfg: OrchestratorConfig, envs: EnvMix, start_step: int) -> GroupTable:
    return GroupTable(
        group_size=cfg.group_size,
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        data=envs,
        retry_unused=cfg.admission.unused_handler == "retry",
        retry_cancelled=not cfg.deterministic,
        max_dropped_groups_per_step=cfg.resolved_max_dropped_groups_per_step,
        next_batch_step=start_step,
        token_rule=cfg.batch.sink.stragglers == "partial" and not cfg.deterministic,
    )


def _watcher(
    cfg: OrchestratorConfig, inputs: ComponentInputs, admission: AdmissionController, groups: GroupTable,
    schedule: DeterministicSchedule | None,
) -> WeightWatcher:  # fmt: skip
    settings = WatcherSettings(
        pause_mode="drain" if schedule is not None else cfg.weights.pause_mode,
        update_interval=cfg.weights.update_interval,
        poll_interval_s=cfg.weights.poll_interval_s,
    )
    return WeightWatcher(
        engines=inputs.engines, loader=inputs.loader, admission=admission, groups=groups, settings=settings,
        clock=inputs.clock, schedule=schedule, request_gate=inputs.request_gate, stalls=inputs.stalls,
        signal=inputs.signal, probe=inputs.probe,
    )  # fmt: skip


def _schedule(cfg: OrchestratorConfig, start_step: int) -> DeterministicSchedule | None:
    if not cfg.deterministic:
        return None
    logger.info("deterministic: fixed dispatch schedule, seeded sampling, drain weight updates")
    return DeterministicSchedule(
        batch_groups=cfg.batch_groups,
        max_off_policy_steps=cfg.max_off_policy_steps,
        max_steps=cfg.max_steps,
        seed=cfg.data.seed,
        start_step=start_step,
    )


def _restore(cfg: OrchestratorConfig, envs: EnvMix) -> tuple[int, dict[str, Any]]:
    """The first step and the checkpoint resumed from ({} when none)."""
    if not cfg.data.ckpt.resume:
        return 0, {}
    state = latest_checkpoint(cfg.output_dir)
    if state is None:
        logger.warning("resume = true but no orchestrator checkpoint in %s: start at step 0", cfg.output_dir)
        return 0, {}
    envs.load_state_dict(state)
    how = " (a planned stop)" if state.get("planned_stop") else ""
    logger.info("resumed from orchestrator checkpoint of step %d%s", state["step"], how)
    return int(state["step"]) + 1, state
