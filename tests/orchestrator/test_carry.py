"""The carry of in-flight work across a restart (`orchestrator/carry.py`): a snapshot of pending groups
round-trips through JSON, work newer than the served version is cut off, each prompt's work is taken
once, and the dispatcher reuses finished episodes and keeps the original dispatch version."""

from __future__ import annotations

import json
import random
from pathlib import Path

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.carry import Carry, snapshot
from prime_async.orchestrator.ckpt import latest_checkpoint, save_checkpoint
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.orchestrator import checkpoint_state
from prime_async.orchestrator.types import Group
from prime_async.rollouts.gateway import GatewayCall
from prime_async.rollouts.types import Episode, PolicySpan
from prime_async.simulation import InMemoryBroadcasts, SimParams, SimulatedEngine, SimulatedRolloutSource
from prime_async.weights.loaders.filesystem import FilesystemLoader


def _episode(versions: list[int]) -> Episode:
    n = len(versions)
    return Episode(
        example_id=3, token_ids=[1, 2, *range(n)], loss_mask=[False, False, *[True] * n],
        sampler_logprobs=[0.0, 0.0, *[-1.0] * n], token_versions=[-1, -1, *versions], reward=0.5,
        span=PolicySpan(1, max(versions)), metrics={"turns": 2, "not_json": object()},
    )  # fmt: skip


def _call(versions: list[int], finish: str = "stop") -> GatewayCall:
    n = len(versions)
    return GatewayCall([1, 2], list(range(n)), [-1.0] * n, versions, finish, max(versions))


def _carry(served: int) -> Carry:
    group = Group(group_id=7, example_id=3, dispatch_version=1, epoch=0, env="e")
    group.finished_by_index[0] = [_episode([1, 1, 2])]
    group.finished_by_index[1] = [_episode([2, 3])]
    calls = {2: [_call([1, 1]), _call([2, 3, 3], "abort")], 3: []}
    state = snapshot([group], 4, lambda g, i: calls.get(i, []))
    return Carry(json.loads(json.dumps(state)), served_version=served)


def test_snapshot_round_trips_and_is_taken_once() -> None:
    carry = _carry(served=3)
    assert carry.num_groups == 1 and carry.carried_tokens == 3 + 2 + 2 + 3 and carry.discarded_tokens == 0
    assert carry.take("e", 3, 1) is None  # another epoch: another prompt
    got = carry.take("e", 3, 0)
    assert got is not None and carry.take("e", 3, 0) is None
    assert got.dispatch_version == 1 and sorted(got.done) == [0, 1] and sorted(got.calls) == [2]
    (ep,) = got.done[0]
    assert ep.token_versions == [-1, -1, 1, 1, 2] and ep.reward == 0.5 and ep.span == PolicySpan(1, 2)
    assert ep.metrics == {"turns": 2}  # what JSON cannot hold is left out
    assert got.calls[2][1].finish_type == "abort" and got.calls[2][1].token_versions == [2, 3, 3]


def test_work_newer_than_the_served_version_is_cut_off() -> None:
    carry = _carry(served=2)  # a rollback to v2: tokens of v3 belong to an abandoned history
    got = carry.take("e", 3, 0)
    assert got is not None and sorted(got.done) == [0]  # episode 1 sampled at v3: regenerated
    first, cut = got.calls[2]
    assert first.output_ids == [0, 1] and cut.output_ids == [0] and cut.finish_type == "abort"
    assert carry.discarded_tokens == 2 + 2


def _orchestrator(out: Path, *, resume: bool):
    """Components of a real orchestrator (simulated engine and source) on `out`."""
    cfg = OrchestratorConfig.model_validate({
        "output_dir": str(out), "max_steps": 8, "batch_groups": 2, "group_size": 4,
        "data": {"ckpt": {"resume": resume}},
        "admission": {"unused_handler": "retry"}, "inference": {"base_urls": ["sim://engine0"]},
        "envs": [{"id": "reverse-text", "name": "e"}],
    })  # fmt: skip
    params = SimParams(num_engines=1)
    engines = [SimulatedEngine(index=0, params=params, rng=random.Random(0))]
    source = SimulatedRolloutSource(engines=engines, params=params, rng=random.Random(0))
    return build_components(
        cfg,
        ComponentInputs(
            source=source, engines=engines, loader=FilesystemLoader(InMemoryBroadcasts()), served_version=3
        ),
    )


def test_a_later_checkpoint_keeps_the_carried_work_not_taken_yet(tmp_path: Path) -> None:
    """A resumed lifetime checkpoints (or stops as planned again) before its dispatcher reissued a carried
    prompt: the prompt is still a retry, and its carried work must be in the new checkpoint too."""
    first = _orchestrator(tmp_path, resume=False)
    group = Group(group_id=7, example_id=3, dispatch_version=1, epoch=0, env=next(iter(first.envs.envs)))
    group.finished_by_index[0] = [_episode([1, 1, 2])]
    calls = {2: [_call([1, 1]), _call([2, 3, 3], "abort")]}
    saved = checkpoint_state(first, [group])
    saved["carry"] = json.loads(json.dumps(snapshot([group], 4, lambda g, i: calls.get(i, []))))
    save_checkpoint(tmp_path, 4, saved)

    resumed = _orchestrator(tmp_path, resume=True)
    assert resumed.carry is not None and resumed.carry.num_groups == 1
    again = json.loads(json.dumps(checkpoint_state(resumed)))  # nothing dispatched yet
    assert again["carry"] == saved["carry"], "the carried work not taken yet must be checkpointed again"
    save_checkpoint(tmp_path, 5, again)
    assert latest_checkpoint(tmp_path)["carry"] == saved["carry"]

    key = (group.env, group.example_id, group.epoch)
    assert resumed.carry.take(*key) is not None  # taken: from now on it is a pending group, not carry
    assert resumed.carry.untaken() == []
