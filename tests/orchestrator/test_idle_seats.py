"""Seats without a turn: a multi-agent episode in which a seat never acted gives an `idle` trajectory (no
model call, no token). It is not an error; the other seats train, the group ships, and the dispatcher
counts it (`rollout/idle_trajectories`) and keeps it from the sink, the advantages and the packer.

Two layers: `build_episodes` classifies a seat's trace (light stand-ins for verifiers' trace objects, the
attributes `rollouts/episode.py` reads); the dispatcher runs groups through the real group table, sink
and batch builder on a virtual clock. The real verifiers game (word-chain with `forfeit`) is in
tests/environments/test_multi_agent.py and, through `rl`, in tests/orchestrator/test_env_kinds_rl.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from test_dispatcher import ScriptedSource, build

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.engine_api import SamplingParams
from prime_async.orchestrator.batching import build_train_batch, seat_advantages
from prime_async.rollouts.episode import build_episodes
from prime_async.rollouts.gateway import GatewaySession
from prime_async.rollouts.types import Episode
from prime_async.simulation import run_virtual

# -- build_episodes: which seat is idle ---------------------------------------------------------------


def _trace(name: str, *, acted: bool, failed_call: bool = False, reward: float = 1.0) -> Any:
    """A verifiers trace stand-in: `acted` -> one branch with a sampled token and one model call."""
    branch = SimpleNamespace(
        token_ids=[5, 6, 7], sampled_mask=[False, False, True], logprobs=[0.0, 0.0, -0.5],
        nodes=[SimpleNamespace(token_ids=[5, 6, 7], mask=[False, False, True])],
    )  # fmt: skip
    calls = [SimpleNamespace(error=None)] if acted else []
    if failed_call:
        calls = [SimpleNamespace(error=SimpleNamespace(type="ProviderError", message="connection reset"))]
    return SimpleNamespace(
        agent=SimpleNamespace(name=name, trainable=True), branches=[branch] if acted else [], calls=calls,
        num_turns=int(acted), metrics={}, rewards={"r": SimpleNamespace(score=reward, value=reward)},
        reward=reward, ok=True, errors=[], is_truncated=False,
    )  # fmt: skip


def _episodes(*traces: Any) -> list[Episode]:
    vf_episode = SimpleNamespace(traces=list(traces), ok=True, errors=[])
    session = GatewaySession(key="k", engine_index=0, sampling=None)
    return build_episodes(example_id=3, vf_episode=vf_episode, session=session, seq_len=64)


def test_a_seat_that_never_acted_is_idle_not_an_error() -> None:
    first, second = _episodes(_trace("first", acted=True, reward=0.2), _trace("second", acted=False))
    assert first.status == "ok" and first.num_completion_tokens == 1 and first.reward == 0.2
    assert second.status == "idle" and second.error is None and second.seat == "second"
    assert second.token_ids == second.loss_mask == second.sampler_logprobs == second.token_versions == []
    assert second.reward == 1.0 and "env_error" not in second.metrics


def test_a_seat_whose_model_call_failed_is_still_an_error() -> None:
    """A failed call is a call: the seat tried to act, so it is the `model_call` error, not idle."""
    _first, second = _episodes(_trace("first", acted=True), _trace("second", acted=False, failed_call=True))
    assert second.status == "error" and second.metrics["env_error"] == "model_call"


def test_a_single_agent_episode_without_a_call_is_still_an_error() -> None:
    """One seat: the environment never asked the policy anything (a broken env, not a game state)."""
    (ep,) = _episodes(_trace("agent", acted=False))
    assert ep.status == "error" and ep.metrics["env_error"] == "empty_completion"


def test_a_failed_rollout_stays_an_error_even_without_a_turn() -> None:
    idle = _trace("second", acted=False)
    idle.ok, idle.errors = False, [SimpleNamespace(type="RuntimeError", message="env crashed")]
    _first, second = _episodes(_trace("first", acted=True), idle)
    assert second.status == "error" and second.metrics["env_error"] == "rollout"


# -- dispatcher, group table, sink and batch: idle trajectories never ship -----------------------------


class ForfeitSource(ScriptedSource):
    """Two seats; seat `second` never acts in the episodes of `idle` (group id, index) (and `first`
    neither in those of `all_idle`). Rewards: first = index (0, 1), second = 10 + index."""

    def __init__(self, idle: set[tuple[int, int]], all_idle: set[tuple[int, int]] = frozenset()):
        super().__init__(seats=("first", "second"))
        self.idle, self.all_idle = idle, all_idle

    async def run_episode(
        self, *, example_id: int, engine_key: str, sampling: SamplingParams, replay: Any = None
    ) -> Any:
        episodes = await super().run_episode(example_id=example_id, engine_key=engine_key, sampling=sampling)
        gid, idx = (int(x[1:]) for x in engine_key.split("-"))
        episodes[1].reward = 10.0 + idx
        for ep in episodes:
            if (gid, idx) in self.all_idle or (ep.seat == "second" and (gid, idx) in self.idle):
                ep.status = "idle"
                ep.token_ids, ep.loss_mask, ep.sampler_logprobs, ep.token_versions = [], [], [], []
        return episodes


def _run(source: ForfeitSource, seconds: float) -> tuple[Any, Any, dict[str, float]]:
    async def go() -> tuple[Any, Any, dict[str, float]]:
        disp, _admission, groups, _sink, _data = build(source, max_inflight=2, max_dropped=100)
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(seconds)
        assert not task.done(), task.exception() if task.done() else None
        window = disp.metrics()
        task.cancel()
        await disp.stop()
        return disp, groups, window

    return run_virtual(go())


def test_idle_trajectories_are_counted_and_never_reach_the_sink() -> None:
    # groups 0 and 1 finish at t = 1: in group 0 `second` never acts in episode 0, in group 1 in neither
    disp, groups, window = _run(ForfeitSource(idle={(0, 0), (1, 0), (1, 1)}), seconds=1.5)
    assert window["rollout/idle_trajectories"] == 3.0
    assert disp.errors.total == 0, "a seat without a turn is not an episode error"
    g0, g1 = groups.buffered()
    assert [(e.seat, e.status) for e in g0.episodes] == [("first", "ok"), ("first", "ok"), ("second", "ok")]
    assert [e.seat for e in g1.episodes] == ["first", "first"], "a seat with no turn in the group: no signal"
    groups.check()  # dispatched == sum of states: the idle trajectories ended as filtered
    counts = groups.counts()
    assert counts["filtered"] == 3 and counts["errored"] == 0 and counts["buffered"] == 5
    # per-seat advantages: `second`'s only trajectory has its own baseline (no idle reward in it)
    assert seat_advantages(g0, AdvantageConfig()) == [-0.5, 0.5, 0.0]
    batch = build_train_batch([g0, g1], step=0, seq_len=64, num_ranks=1, temperature=1.0,
                              advantage_cfg=AdvantageConfig(), share_prefix=True)  # fmt: skip
    assert batch.num_loss_tokens == 5, "one loss token per trajectory that acted"


def test_a_group_whose_every_trajectory_is_idle_is_filtered_not_errored() -> None:
    everything = {(0, 0), (0, 1)}
    disp, groups, window = _run(ForfeitSource(idle=set(), all_idle=everything), seconds=1.5)
    assert window["rollout/idle_trajectories"] == 4.0
    assert disp.errors.total == 0
    assert [g.group_id for g in groups.buffered()] == [1], "group 0 had nothing to train"
    groups.check()
    assert groups.counts()["filtered"] == 4 and groups.counts()["errored"] == 0


def test_idle_seats_do_not_hide_failing_episodes_from_fail_fast() -> None:
    """A group whose acting seats all failed is a failed group, whatever its idle seats."""

    class Failing(ForfeitSource):
        async def run_episode(self, **kw: Any) -> Any:
            episodes = await super().run_episode(**kw)
            episodes[0].status, episodes[0].error = "error", "rollout: env crashed"
            return episodes

    async def go() -> BaseException | None:
        disp, *_ = build(Failing(idle={(g, i) for g in range(4) for i in range(2)}), fail_fast=2)
        task = asyncio.create_task(disp.run())
        await asyncio.sleep(1.5)
        error = task.exception() if task.done() else None
        task.cancel()
        await disp.stop()
        return error

    assert "every episode of the first" in str(run_virtual(go()))


def test_eval_counts_idle_seats_apart_from_errors_and_rewards() -> None:
    from prime_async.eval.episodes import EvalEnv, env_metrics

    acted = Episode(example_id=0, token_ids=[1, 2], loss_mask=[False, True], sampler_logprobs=[0.0, -1.0],
                    token_versions=[-1, 4], reward=0.25, seat="first")  # fmt: skip
    idle = Episode(example_id=0, reward=1.0, seat="second", status="idle")
    env = EvalEnv(name="game", source=None, sampling=SamplingParams(), example_ids=[0])  # type: ignore[arg-type]
    metrics = env_metrics(env, 4, [(0, 0, [acted, idle])])
    assert metrics["eval/game/num_idle"] == 1.0 and metrics["eval/game/num_errors"] == 0.0
    assert metrics["eval/game/num_episodes"] == 1.0 and metrics["eval/game/reward/mean"] == 0.25
    assert metrics["eval/game/pass@1"] == 0.0, "the idle seat's reward is not the policy's"
