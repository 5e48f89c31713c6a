"""Candidate async settings and their simulated step time and staleness.

Each candidate is the user's orchestrator config with K, `max_inflight_groups`, `max_buffered_groups` and
the number of engines changed. It runs through `simulation.run_simulation` (the real admission,
dispatcher, group table, train sink and weight watcher on a virtual clock) with engines and a trainer whose
timings come from a `Profile`:

- every group draws the latencies of one measured group (its episodes' seconds, in order): tails within
  a group are kept, and a stall that slowed a whole group stays one group's worth;
- an engine is throughput-bound beyond the most episodes it ran at once in the profile (`saturation`):
  with more running on it, each one slows down in proportion (with fewer, it is not faster: conservative);
- the trainer takes the measured train time per step and writes each version in the background for the
  measured write time (one write at a time), an engine takes the measured weight update time, the
  orchestrator the measured batch cut time.

The prediction for a candidate is the mean simulated `time/step` after the warm-up, over a few seeds, and
the staleness shares of the groups trained after the warm-up.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.plan.profile import WARMUP_STEPS, Profile
from prime_async.simulation import SimParams, run_simulation, run_virtual

SIM_STEPS = 24
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Candidate:
    """One setting of the async knobs; `engines` is the number of inference engines per trainer."""

    k: int
    max_inflight_groups: int
    max_buffered_groups: int
    engines: int
    current: bool = field(default=False, compare=False)  # the config as given (not part of the setting)

    def flags(self) -> str:
        return (
            f"--orchestrator.max_off_policy_steps {self.k} --orchestrator.admission.max_inflight_groups "
            f"{self.max_inflight_groups} --orchestrator.admission.max_buffered_groups "
            f"{self.max_buffered_groups}"
        )


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_time_s: float
    staleness: dict[int, float]  # step - dispatch_version of the trained groups -> fraction

    def staleness_text(self) -> str:
        return " ".join(f"{age}:{frac:.0%}" for age, frac in sorted(self.staleness.items()))


def current_candidate(cfg: OrchestratorConfig) -> Candidate:
    return Candidate(
        k=cfg.max_off_policy_steps,
        max_inflight_groups=min(cfg.resolved_max_inflight_groups, cfg.resolved_max_buffered_groups),
        max_buffered_groups=cfg.resolved_max_buffered_groups,
        engines=max(1, len(cfg.inference.base_urls)),
        current=True,
    )


def candidate_grid(cfg: OrchestratorConfig, ks: tuple[int, ...] = (0, 1, 2, 4)) -> list[Candidate]:
    """The user's setting first, then K in `ks` x buffered in {(K + 1) batches, the user's if it fits} x
    in flight in {half the buffer, the whole buffer} x engines in {n, 2n}."""
    cur = current_candidate(cfg)
    seen, out = {cur}, [cur]
    for engines in (cur.engines, 2 * cur.engines):
        for k in ks:
            # a buffer of at most K batches would make a smaller K the same candidate
            buffers = {(k + 1) * cfg.batch_groups}
            if (
                max(k * cfg.batch_groups + 1, cfg.batch_groups)
                <= cur.max_buffered_groups
                < (k + 1) * cfg.batch_groups
            ):
                buffers.add(cur.max_buffered_groups)
            for buffered in sorted(buffers):
                for inflight in sorted({max(1, math.ceil(buffered / 2)), buffered}):
                    cand = Candidate(k, inflight, buffered, engines)
                    if cand not in seen:
                        seen.add(cand)
                        out.append(cand)
    return out


def simulation_config(cfg: OrchestratorConfig, cand: Candidate, output_dir: str) -> OrchestratorConfig:
    """`cfg` with the candidate's knobs, no checkpoints, eval, teacher or resume (only scheduling counts)."""
    data: dict[str, Any] = cfg.model_dump()
    data.update(output_dir=output_dir, max_steps=SIM_STEPS, max_off_policy_steps=cand.k, teacher=None)
    data["admission"] = {
        **data["admission"], "max_inflight_groups": cand.max_inflight_groups,
        "max_buffered_groups": cand.max_buffered_groups, "max_dropped_groups_per_step": 10_000,
        "fail_fast_groups": 0,
    }  # fmt: skip
    data["data"] = {**data["data"], "ckpt": {"interval": None, "resume": False}}
    data["eval"] = {}
    data["inference"] = {**data["inference"], "base_urls": [f"sim://engine{i}" for i in range(cand.engines)]}
    return OrchestratorConfig.model_validate(data)


def sim_params(profile: Profile, cand: Candidate, slots: int, seed: int) -> SimParams:
    return SimParams(
        num_engines=cand.engines, num_examples=100_000, latency_groups=profile.latency_groups,
        saturation=profile.concurrency_per_engine, engine_slots=slots, train_time_s=profile.train_time_s,
        update_time_s=profile.update_time_s, cut_time_s=profile.cut_time_s, seed=seed,
        write_time_s=profile.write_time_s,
    )  # fmt: skip


def predict(cfg: OrchestratorConfig, profile: Profile, cand: Candidate) -> Prediction:
    """Simulate `cand` over `SEEDS`; the mean step time after the warm-up and the staleness histogram."""
    step_times: list[float] = []
    ages: Counter[int] = Counter()
    with tempfile.TemporaryDirectory(prefix="prime-async-plan-") as tmp:
        sim_cfg = simulation_config(cfg, cand, tmp)
        for seed in SEEDS:
            params = sim_params(profile, cand, cfg.inference.max_running_requests, seed)
            result = run_virtual(run_simulation(sim_cfg, params, instrument=False))
            step_times += [m["time/step"] for step, m in result.metrics.items() if step >= WARMUP_STEPS]
            for step, groups in result.trained.items():
                if step >= WARMUP_STEPS:  # the steady state, as the step time (and as validation measures)
                    ages.update(step - g.dispatch_version for g in groups)
    total = sum(ages.values()) or 1
    return Prediction(
        candidate=cand,
        step_time_s=statistics.fmean(step_times),
        staleness={age: n / total for age, n in ages.items()},
    )
