"""build_train_batch: advantages against a plain reference, packing and rank-balance invariants."""

from __future__ import annotations

import random
import statistics

import numpy as np

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.orchestrator.batching import build_train_batch, group_advantages, seat_advantages
from prime_async.orchestrator.types import Episode, Group


def episode(prompt: int, completion: int, reward: float, version: int = 0) -> Episode:
    n = prompt + completion
    return Episode(
        example_id=0,
        token_ids=list(range(1, n + 1)),
        loss_mask=[False] * prompt + [True] * completion,
        sampler_logprobs=[0.0] * prompt + [-0.5] * completion,
        token_versions=[-1] * prompt + [version] * completion,
        reward=reward,
    )


def test_group_advantages_match_reference():
    rewards = [0.0, 1.0, 0.5, 0.5]
    mean = sum(rewards) / 4
    assert group_advantages(rewards, AdvantageConfig()) == [r - mean for r in rewards]
    std = statistics.pstdev(rewards)
    normed = group_advantages(rewards, AdvantageConfig(std_normalize=True, eps=1e-6))
    assert np.allclose(normed, [(r - mean) / (std + 1e-6) for r in rewards])


def test_packing_invariants_and_rank_balance():
    rng = random.Random(0)
    groups = []
    for g in range(8):
        eps = [episode(rng.randint(1, 10), rng.randint(1, 30), rng.random(), version=g) for _ in range(4)]
        groups.append(Group(group_id=g, example_id=g, dispatch_version=g % 3, episodes=eps))
    batch = build_train_batch(
        groups, step=5, seq_len=64, num_ranks=3, temperature=0.7, advantage_cfg=AdvantageConfig()
    )
    assert batch.step == 5 and batch.temperature == 0.7 and batch.min_dispatch_version == 0
    assert len({len(rank) for rank in batch.micro_batches}) == 1  # same number of micro-batches per rank
    total_tokens = sum(len(e.token_ids) for g in groups for e in g.episodes)
    seen_tokens = 0
    for rank in batch.micro_batches:
        for mb in rank:
            assert mb.num_tokens <= 64
            lengths = {len(a) for a in (mb.input_ids, mb.position_ids, mb.loss_mask, mb.advantages,
                                        mb.sampler_logprobs, mb.token_versions)}  # fmt: skip
            assert lengths == {mb.num_tokens}
            starts = np.flatnonzero(mb.position_ids == 0)
            ends = [*starts[1:], mb.num_tokens]
            for s, e in zip(starts, ends, strict=True):  # positions restart at 0 per sample
                assert list(mb.position_ids[s:e]) == list(range(e - s))
            assert np.all(mb.advantages[~mb.loss_mask] == 0) and np.all(
                mb.token_versions[~mb.loss_mask] == -1
            )
            seen_tokens += int(mb.loss_mask.any()) and mb.num_tokens
    assert seen_tokens == total_tokens
    assert batch.num_loss_tokens == sum(e.num_completion_tokens for g in groups for e in g.episodes)
    loads = [sum(mb.num_tokens for mb in rank) for rank in batch.micro_batches]
    assert max(loads) - min(loads) <= 64


def test_advantages_land_on_loss_tokens_of_their_sample():
    g = Group(group_id=0, example_id=0, dispatch_version=0, episodes=[episode(2, 3, 1.0), episode(2, 3, 0.0)])
    batch = build_train_batch(
        [g], step=0, seq_len=5, num_ranks=1, temperature=1.0, advantage_cfg=AdvantageConfig()
    )
    advs = sorted(float(mb.advantages[mb.loss_mask][0]) for mb in batch.micro_batches[0])
    assert advs == [-0.5, 0.5]


def test_short_rank_gets_padding_rows():
    g = Group(group_id=0, example_id=0, dispatch_version=0, episodes=[episode(1, 3, 1.0)])
    batch = build_train_batch(
        [g], step=0, seq_len=8, num_ranks=2, temperature=1.0, advantage_cfg=AdvantageConfig()
    )
    pad = [mb for rank in batch.micro_batches for mb in rank if not mb.loss_mask.any()]
    assert len(pad) == 1 and pad[0].num_tokens == 1


def test_seats_are_their_own_baselines():
    """Two-seat groups: each seat's advantage is relative to the same seat's rewards only."""
    eps = [episode(1, 2, r) for r in (1.0, 10.0, 0.0, 20.0)]
    for ep, seat in zip(eps, ("white", "black", "white", "black"), strict=True):
        ep.seat = seat
    g = Group(group_id=0, example_id=0, dispatch_version=0, episodes=eps)
    assert seat_advantages(g, AdvantageConfig()) == [0.5, -5.0, -0.5, 5.0]
    single = Group(
        group_id=1, example_id=1, dispatch_version=0, episodes=[episode(1, 2, r) for r in (1.0, 3.0)]
    )
    assert seat_advantages(single, AdvantageConfig()) == group_advantages(single.rewards, AdvantageConfig())
