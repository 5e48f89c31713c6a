"""Length bias (`orchestrator/length_bias.py`): every generated trajectory counted once in one unit, the
filters' share apart from staleness's, and a warning only when trained episodes are shorter beyond
noise. The simulator tests are the review's `lb_noise*.py` reproductions (length independent of latency:
no warning) and their converse (the slow episodes are the long ones: a warning)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.length_bias import LengthBias
from prime_async.orchestrator.train_sink import TrainSink
from prime_async.orchestrator.types import Group
from prime_async.rollouts.episode import _sampled_tokens
from prime_async.rollouts.types import Episode
from prime_async.rollouts.verifiers_source import SampledShare
from prime_async.simulation import SimParams, run_simulation, run_virtual

LOGGER = "prime_async.orchestrator.length_bias"


def _eps(lengths: list[int]) -> list[Episode]:
    return [Episode(example_id=0, loss_mask=[True] * n) for n in lengths]


def _group(env: str, lengths: list[int], gid: int = 0) -> Group:
    group = Group(group_id=gid, example_id=0, dispatch_version=0, env=env)
    group.episodes = _eps(lengths)
    return group


def _accept(bias: LengthBias, group: Group) -> Group:
    bias.finished(group, list(group.episodes), accepted=True)
    return group


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_bias_is_trained_over_eligible_mean_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    bias = LengthBias()
    rng = random.Random(0)
    short = [_accept(bias, _group("a", [rng.randint(8, 12) for _ in range(2)])) for _ in range(20)]
    for _ in range(20):  # the long groups: accepted, then dropped as stale (never trained)
        _accept(bias, _group("a", [rng.randint(28, 32) for _ in range(2)]))
    bias.trained(short)
    b = bias.bias("a")
    assert b is not None and b.judged
    assert b.value == pytest.approx(bias.metrics()["rollout/length/trained/mean"] / 20, rel=0.05)
    assert b.high < 0.6
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bias.warn_if_biased()
        bias.warn_if_biased()
    (message,) = _warnings(caplog)
    assert "env a: trained episodes are 49% shorter" in message and "at least 47%" in message


def test_cancelled_group_counts_its_finished_siblings_and_running_partials() -> None:
    """(a) a group cancelled in flight: its finished (short) episodes are generated too, not only the
    running ones; (b) a group cancelled while the teacher scored it (all finished) counts whole."""
    bias = LengthBias()
    cancelled = Group(group_id=1, example_id=0, dispatch_version=0, env="a")
    cancelled.finished_by_index = {0: _eps([10]), 1: _eps([12])}
    bias.cancelled_group(cancelled, partial=[50, 0])  # one running episode had sampled nothing yet
    scored = Group(group_id=2, example_id=0, dispatch_version=0, env="a")
    scored.finished_by_index = {0: _eps([20]), 1: _eps([8])}
    bias.cancelled_group(scored, partial=[])
    m = bias.metrics()
    assert m["rollout/length/generated/mean"] == pytest.approx((10 + 12 + 50 + 20 + 8) / 5)
    assert m["rollout/length/cancelled/mean"] == m["rollout/length/generated/mean"]
    assert m["rollout/length/empty"] == 1.0  # the episode cancelled before its first token


def test_filters_are_not_attributed_to_staleness(caplog: pytest.LogCaptureFixture) -> None:
    """(d) `reject_equal_reward` removes the long groups: the gap is the filter's, reported apart."""
    bias = LengthBias()
    rng = random.Random(1)
    kept = []
    for gid in range(40):
        long = gid % 2 == 0
        group = _group("a", [rng.randint(40, 60) if long else rng.randint(5, 15) for _ in range(4)], gid)
        bias.finished(group, list(group.episodes), accepted=not long)  # the sink filtered the long ones
        if not long:
            kept.append(group)
    overlong = _group("a", [10, 3000], 99)  # the sink's overlong policy dropped one trajectory
    before = list(overlong.episodes)
    overlong.episodes = overlong.episodes[:1]
    bias.finished(overlong, before, accepted=True)
    bias.trained([*kept, overlong])
    m = bias.metrics()
    assert m["rollout/length_bias"] == pytest.approx(1.0)
    assert m["rollout/length_bias/filters"] < 0.5
    assert m["rollout/length/filtered/share"] == pytest.approx(81 / 162)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bias.warn_if_biased()
    assert not _warnings(caplog)


def test_empty_trajectories_count_in_no_population() -> None:
    """A seat without a turn (no token) is not a length-0 sample on either side."""
    bias = LengthBias()
    group = _accept(bias, _group("a", [10, 0, 20]))
    bias.trained([group])
    m = bias.metrics()
    assert m["rollout/length/generated/mean"] == m["rollout/length/trained/mean"] == 15.0
    assert m["rollout/length_bias"] == 1.0
    assert m["rollout/length/empty"] == 1.0


def test_length_is_the_sampled_tokens_snapshotted_before_truncation() -> None:
    """(c) one unit: what the trajectory sampled (`metrics["sampled_tokens"]`), not the trained branch's
    loss tokens, fixed when first counted (the sink's overlong truncation does not change it)."""
    bias = LengthBias()
    (ep,) = _eps([10])
    ep.metrics["sampled_tokens"] = 25  # earlier branches of a re-tokenizing multi-turn episode
    group = Group(group_id=0, example_id=0, dispatch_version=0, env="a", episodes=[ep])
    _accept(bias, group)
    ep.loss_mask = ep.loss_mask[:4]
    bias.trained([group])
    m = bias.metrics()
    assert m["rollout/length/generated/mean"] == m["rollout/length/trained/mean"] == 25.0


def test_sampled_tokens_of_a_trace_count_every_branch() -> None:
    node = SimpleNamespace
    trace = SimpleNamespace(nodes=[node(mask=[False, False]), node(mask=[True] * 5), node(mask=[False]),
                                   node(mask=[True] * 7)])  # fmt: skip
    assert _sampled_tokens(trace, Episode(example_id=0, loss_mask=[True] * 7)) == 12
    assert _sampled_tokens(SimpleNamespace(), Episode(example_id=0, loss_mask=[True] * 7)) == 7


def test_a_cancelled_multi_seat_episode_counts_per_trajectory() -> None:
    """(c) the gateway's calls of a cancelled episode are all seats' (and untrained seats'): they count as
    the trained trajectories per episode the finished episodes showed, each with its share."""
    share = SampledShare()
    assert share.split(40) == [40]  # nothing learned yet: one trajectory with every token
    for _ in range(3):
        share.observe(100, [30, 50])  # two trained seats sampled 80 of the session's 100 tokens
    assert share.split(60) == [24, 24]
    single = SampledShare()
    single.observe(70, [70])
    assert single.split(33) == [33]


def _noise_groups(rng: random.Random, bias: LengthBias, n_groups: int, caplog) -> int:
    """Groups of 4 alike episodes (a per-prompt length), a third of them removed whatever their length;
    the warning is checked after every batch of 4 groups, as the main loop does. Returns warnings."""
    batch = []
    for gid in range(n_groups):
        base = rng.lognormvariate(4, 0.8)
        group = _accept(
            bias, _group("a", [max(1, round(base * rng.uniform(0.7, 1.3))) for _ in range(4)], gid)
        )
        if rng.random() > 1 / 3:
            batch.append(group)
        if len(batch) == 4:
            bias.trained(batch)
            batch = []
            bias.warn_if_biased()
    return len(_warnings(caplog))


def test_no_warning_when_length_is_independent_of_removal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for seed in range(30):
            assert _noise_groups(random.Random(seed), LengthBias(), 120, caplog) == 0, f"seed {seed}"


def test_warning_when_the_slow_long_groups_are_removed(caplog: pytest.LogCaptureFixture) -> None:
    """Length proportional to latency; a group is dropped when its slowest episode misses the deadline."""
    rng = random.Random(7)
    bias = LengthBias()
    trained = []
    for gid in range(120):
        latencies = [rng.paretovariate(1.5) for _ in range(4)]
        group = _accept(bias, _group("a", [round(20 * t) for t in latencies], gid))
        if max(latencies) < 3.0:
            trained.append(group)
    bias.trained(trained)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bias.warn_if_biased()
    assert len(_warnings(caplog)) == 1
    assert bias.bias("a").high < 0.9


# -- the simulator: the real dispatcher, group table, sink, length bias and main loop --------------------


class ImpatientSink(TrainSink):
    """Cuts each batch from the first finished groups, never waiting for an older one in flight (what the
    default sink did before the shipping plan): the slow groups miss their K and are cancelled."""

    async def get_batch(self, step: int) -> list[Group]:
        while True:
            self.sweep(step)
            ready = self.groups.buffered()
            if len(ready) >= self.batch_groups:
                batch = ready[: self.batch_groups]
                self.groups.take(batch, step)
                return batch
            self.groups.returned.clear()
            await self.groups.returned.wait()


def _simulate(tmp_path: Path, seed: int, tokens_per_s: float | None, caplog) -> tuple[dict, int]:
    cfg = OrchestratorConfig.model_validate({
        "output_dir": str(tmp_path / f"s{seed}"), "max_steps": 60, "batch_groups": 2, "group_size": 2,
        "max_off_policy_steps": 1,
        "admission": {"max_buffered_groups": 8, "max_dropped_groups_per_step": 1000},
        "inference": {"base_urls": ["sim://engine0"]}, "sampling": {"max_tokens": 4096}, "seq_len": 8192,
        "batch": {"sink": {"import_path": f"{__name__}:ImpatientSink", "stragglers": "wait"}},
    })  # fmt: skip
    params = SimParams(num_engines=1, seed=seed, latency_s=0.2, pareto_alpha=1.2, train_time_s=2.0,
                       max_new_tokens=1024, num_chunks=16, tokens_per_s=tokens_per_s)  # fmt: skip
    caplog.clear()
    res = run_virtual(run_simulation(cfg, params, instrument=False))
    return res.metrics[max(res.metrics)], len(_warnings(caplog))


def test_simulated_length_independent_of_latency_never_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's lb_noise: groups are cancelled (the slow ones), but length does not follow latency."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for seed in range(4):
            last, warnings = _simulate(tmp_path, seed, None, caplog)
            assert last["ledger/cancelled"] > 0, (
                "the workload must cancel groups for the test to mean anything"
            )
            assert warnings == 0, f"seed {seed}: {last['rollout/length_bias']}"


def test_simulated_slow_long_episodes_cancelled_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for seed in (0, 2):
            last, warnings = _simulate(tmp_path, seed, 100.0, caplog)
            assert warnings >= 1, f"seed {seed}: {last.get('rollout/length_bias')}"
            assert last["rollout/length_bias/high"] < 0.98
            assert last["rollout/length/cancelled/mean"] > last["rollout/length/trained/mean"]
