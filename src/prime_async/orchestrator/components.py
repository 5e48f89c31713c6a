"""The parts one orchestrator lifetime runs with, built by `orchestrator.build_components`.

A plain record: modules that act on a running orchestrator (the planned stop, the simulator) type against
it without importing the loop, so the package keeps no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_async.orchestrator.admission import AdmissionController
from prime_async.orchestrator.carry import Carry
from prime_async.orchestrator.dispatcher import Dispatcher
from prime_async.orchestrator.engine_load import EngineLoad
from prime_async.orchestrator.env_mix import EnvMix
from prime_async.orchestrator.groups import GroupTable
from prime_async.orchestrator.length_bias import LengthBias
from prime_async.orchestrator.train_sink import Sink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.teacher import TeacherScorer
from prime_async.weights.watcher import WeightWatcher


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
