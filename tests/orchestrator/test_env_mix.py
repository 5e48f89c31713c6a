"""The environment mix: the schedule's bound at every prefix (also with slots given back), routing of
unused groups to their env, checkpoint round trips, and a two-env run resumed mid-way on the simulator
(no prompt of either env skipped or issued twice, schedule restored)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import SamplingParams
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.env_mix import EnvMix, MixEnv, MixSchedule
from prime_async.orchestrator.types import Group
from prime_async.simulation import InMemoryBroadcasts, SimParams, run_simulation, run_virtual

RATIOS = st.lists(st.sampled_from([0.5, 1, 1.5, 2, 3, 7, 10]), min_size=1, max_size=5)


def deviation(schedule: MixSchedule) -> Fraction:
    n = sum(schedule.counts.values())
    return max(abs(schedule.counts[x] - n * schedule.shares[x]) for x in schedule.names)


def bound(m: int) -> Fraction:
    return 1 - Fraction(1, 2 * (m - 1)) if m > 1 else Fraction(0)


@settings(max_examples=200, deadline=None)
@given(ratios=RATIOS, n=st.integers(1, 300))
def test_every_prefix_is_within_one_group_of_the_ratio(ratios: list[float], n: int) -> None:
    schedule = MixSchedule({f"env{i}": r for i, r in enumerate(ratios)})
    for _ in range(n):
        schedule.next()
        assert deviation(schedule) <= bound(len(ratios))


@settings(max_examples=200, deadline=None)
@given(ratios=RATIOS, bursts=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), max_size=40))
def test_slots_given_back_are_refilled_to_the_ratio(ratios: list[float], bursts: list[tuple[int, int]]):
    schedule = MixSchedule({f"env{i}": r for i, r in enumerate(ratios)})
    for dispatches, give_backs in bursts:
        for _ in range(dispatches):
            schedule.next()
        returned = 0
        for i in range(give_backs):  # a burst of groups ended untrained, then as many dispatches
            name = schedule.names[i % len(ratios)]
            if schedule.counts[name] > 0:
                schedule.give_back(name)
                returned += 1
        for _ in range(returned):
            schedule.next()
        assert deviation(schedule) <= bound(len(ratios))


def test_three_to_one_is_exact_every_four_groups() -> None:
    schedule = MixSchedule({"a": 3, "b": 1})
    picks = [schedule.next() for _ in range(16)]
    assert all(picks[i : i + 4].count("b") == 1 for i in range(0, 16, 4))


def mix(**sizes: int) -> EnvMix:
    return EnvMix([
        MixEnv(name, source=None, data=DataSource(num_examples=n, seed=1), sampling=SamplingParams(),
               ratio=3 if name == "a" else 1)  # type: ignore[arg-type]
        for name, n in sizes.items()
    ])  # fmt: skip


def test_an_unused_group_goes_back_to_its_own_env() -> None:
    envs = mix(a=6, b=4)
    issued = [envs.next_prompt() for _ in range(4)]
    env, example_id, epoch = next(p for p in issued if p[0].name == "b")
    group = Group(group_id=0, example_id=example_id, dispatch_version=0, epoch=epoch, env="b")
    envs.unused_group(group, retry=True)
    assert envs.schedule.counts == {"a": 3, "b": 0} and envs.num_retry_pending == 1
    env, again, _ = envs.next_prompt()  # b is behind: picked next, its retried prompt first
    assert (env.name, again) == ("b", example_id)
    envs.unused_group(Group(group_id=1, example_id=0, dispatch_version=0, env="a"), retry=False)
    assert envs.schedule.counts == {"a": 2, "b": 1} and envs.num_retry_pending == 0


def test_state_round_trip_reissues_each_envs_pending_prompts() -> None:
    envs = mix(a=12, b=4)
    issued = [envs.next_prompt() for _ in range(8)]
    pending = [Group(group_id=i, example_id=e, dispatch_version=0, epoch=ep, env=env.name)
               for i, (env, e, ep) in enumerate(issued[5:])]  # fmt: skip
    state = envs.state_dict(pending=pending)
    resumed = mix(a=12, b=4)
    resumed.load_state_dict(state)
    assert sum(resumed.schedule.counts.values()) == 5  # the pending groups' slots are free again
    rest = [resumed.next_prompt() for _ in range(11)]
    for name, size in (("a", 12), ("b", 4)):
        first = [(e, ep) for env, e, ep in issued[:5] if env.name == name]
        again = [(e, ep) for env, e, ep in rest if env.name == name]
        pending_here = [(g.example_id, g.epoch) for g in pending if g.env == name]
        assert again[: len(pending_here)] == pending_here  # reissued first
        epoch0 = sorted(e for e, ep in first + again if ep == 0)
        assert epoch0 == sorted(set(epoch0)) and len(epoch0) == min(size, len(first + again))


def test_checkpoint_of_another_mix_is_refused_and_a_one_env_checkpoint_still_loads() -> None:
    with pytest.raises(ValueError, match=r"same orchestrator\.envs names"):
        mix(a=4, c=4).load_state_dict(mix(a=4, b=4).state_dict())
    old = {"data": DataSource(num_examples=4, seed=1).state_dict()}  # before environment mixes
    single = mix(a=4)
    single.load_state_dict(old)
    with pytest.raises(ValueError, match="mixes several"):
        mix(a=4, b=4).load_state_dict(old)


def two_env_config(tmp_path: Path, **kw) -> OrchestratorConfig:
    base = dict(
        batch_groups=4, group_size=2, max_off_policy_steps=8,
        admission={"max_buffered_groups": 8, "unused_handler": "retry"},
        output_dir=tmp_path,
        data={"ckpt": {"interval": 3}}, wandb={"enabled": False},
        envs=[{"id": "sim", "name": "a", "ratio": 3, "args": {"num_examples": 30}},
              {"id": "sim", "name": "b", "ratio": 1, "args": {"num_examples": 10}}],
    )  # fmt: skip
    return OrchestratorConfig(**{**base, **kw})


def test_two_envs_resumed_mid_run_skip_and_repeat_no_prompt(tmp_path: Path) -> None:
    params = SimParams(seed=5, latency_s=1.0, pareto_alpha=1.2)
    first = run_virtual(run_simulation(two_env_config(tmp_path, max_steps=7), params))  # ckpt at 2, 5
    trained = [(g.env, g.example_id, g.epoch) for s in range(6) for g in first.trained[s]]  # 6 is lost
    ckpt = json.loads((tmp_path / "checkpoints" / "orchestrator" / "step_5.json").read_text())
    by_env = {n: sum(1 for env, _, _ in trained if env == n) for n in ("a", "b")}
    assert ckpt["schedule"]["counts"] == by_env  # at a checkpoint the schedule counts = groups trained
    broadcasts = InMemoryBroadcasts()
    broadcasts.latest = 6  # the trainer restarts from its step-5 checkpoint
    cfg = two_env_config(tmp_path, max_steps=12, data={"ckpt": {"interval": 3, "resume": True}})
    second = run_virtual(run_simulation(cfg, params, broadcasts=broadcasts))
    assert sorted(second.trained) == list(range(6, 12))
    resumed = second.metrics[6]  # the restored counts + the groups dispatched since, minus the unused
    assert resumed["rollout/env/a/scheduled_groups"] + resumed["rollout/env/b/scheduled_groups"] >= 28
    trained += [(g.env, g.example_id, g.epoch) for s in range(6, 12) for g in second.trained[s]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    comps = second.comps
    leftover = {(g.env, g.example_id, g.epoch) for g in comps.groups.pending_groups()}
    for name, env in comps.envs.envs.items():
        leftover |= {(name, e, ep) for e, ep in env.data.state_dict()["retry"]}
    for name, size in (("a", 30), ("b", 10)):  # 48 trained: each env went past its first epoch
        seen = {(e, ep) for n, e, ep in set(trained) | leftover if n == name}
        assert {(e, 0) for e in range(size)} <= seen, f"env {name}: an epoch-0 prompt was skipped"
    b_count = sum(1 for env, _, _ in trained if env == "b")
    assert abs(b_count - len(trained) / 4) <= 1, (b_count, len(trained))  # 3:1 within one group
