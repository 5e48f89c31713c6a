"""build_train_batch: advantages against a plain reference, packing and rank-balance invariants."""

from __future__ import annotations

import random
import statistics

import numpy as np

from prime_async.config.orchestrator import AdvantageConfig
from prime_async.orchestrator.batching import (
    build_train_batch,
    group_advantages,
    seat_advantages,
    shared_prefix_length,
)
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode


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
    assert len(pad) == 1 and pad[0].num_tokens == 2  # MicroBatch.padding(), as the trainer pads its ranks


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


def _shared_episode(rng: random.Random, prompt: list[int], seat: str = "agent") -> Episode:
    """`prompt`, then a sampled turn, sometimes a tool/user turn and a second sampled turn."""
    turns = [(prompt, False), ([rng.randint(1, 999) for _ in range(rng.randint(1, 8))], True)]
    if rng.random() < 0.5:
        turns += [([rng.randint(1, 999) for _ in range(rng.randint(1, 4))], False)]
        turns += [([rng.randint(1, 999) for _ in range(rng.randint(1, 5))], True)]
    ids = [t for part, _ in turns for t in part]
    mask = [m for part, m in turns for _ in part]
    return Episode(
        example_id=0, token_ids=ids, loss_mask=mask, sampler_logprobs=[-0.25 if m else 0.0 for m in mask],
        token_versions=[3 if m else -1 for m in mask], reward=rng.random(), seat=seat,
    )  # fmt: skip


def _unpacked_samples(batch) -> list[tuple[tuple[int, ...], tuple[bool, ...], tuple[float, ...]]]:
    """Every packed sample rebuilt whole (a branch gets its block's shared tokens back): (ids, loss mask,
    advantages), advantages 0 on the shared tokens."""
    from prime_async.trainer.packed_rows import sample_starts

    out = []
    for rank in batch.micro_batches:
        for mb in rank:
            begin = np.flatnonzero(sample_starts(mb.position_ids)).tolist()
            block = 0
            for start, end in zip(begin, [*begin[1:], mb.num_tokens], strict=True):
                shared = int(mb.position_ids[start])
                if shared == 0:
                    block = start
                assert list(mb.position_ids[start:end]) == list(range(shared, shared + end - start))
                assert not mb.loss_mask[start]  # a sample's first token has no context of its own
                ids = [*mb.input_ids[block : block + shared], *mb.input_ids[start:end]]
                mask = [*[False] * shared, *mb.loss_mask[start:end]]
                adv = [*[0.0] * shared, *mb.advantages[start:end]]
                out.append((tuple(int(t) for t in ids), tuple(bool(m) for m in mask), tuple(adv)))
    return out


def test_shared_prefix_packing_keeps_every_episode_and_saves_the_prompt_copies():
    rng = random.Random(1)
    groups = []
    for g in range(6):
        prompt = [rng.randint(1, 999) for _ in range(rng.randint(3, 20))]
        eps = [_shared_episode(rng, prompt) for _ in range(rng.randint(1, 5))]
        groups.append(Group(group_id=g, example_id=g, dispatch_version=0, episodes=eps))
    kwargs = dict(step=0, seq_len=48, num_ranks=2, temperature=1.0, advantage_cfg=AdvantageConfig())
    plain = build_train_batch(groups, **kwargs)
    shared = build_train_batch(groups, share_prefix=True, **kwargs)
    assert sorted(_unpacked_samples(shared)) == sorted(_unpacked_samples(plain))  # same samples, same data
    assert shared.num_loss_tokens == plain.num_loss_tokens
    every = sum(len(e.token_ids) for g in groups for e in g.episodes)
    assert shared.metrics["batch/sample_tokens"] == plain.metrics["batch/packed_tokens"] == every
    assert shared.metrics["batch/packed_tokens"] < every
    for rank in shared.micro_batches:
        assert all(mb.num_tokens <= 48 for mb in rank)


def test_shared_prefix_is_the_common_prompt_cut_before_the_first_loss_token():
    rng = random.Random(2)
    prompt = list(range(1, 11))
    eps = [_shared_episode(rng, prompt) for _ in range(4)]
    assert shared_prefix_length(eps) == 9  # the 10th prompt token opens every branch
    eps[2].token_ids[4] = 5000  # one episode differs at token 4: only 4 tokens are shared
    assert shared_prefix_length(eps) == 4
    assert shared_prefix_length(eps[:1]) == 0
    eps[0].token_ids[0] = 5000
    assert shared_prefix_length(eps) == 0


def test_shared_prefix_is_per_seat_and_groups_split_at_seq_len():
    """Two seats with their own prompts share within the seat only; a group longer than seq_len is split
    into units that each carry the prompt."""
    rng = random.Random(3)
    eps = [_shared_episode(rng, [1, 2, 3, 4, 5, 6], "white") for _ in range(3)]
    eps += [_shared_episode(rng, [9, 8, 7, 6, 5, 4, 3], "black") for _ in range(3)]
    g = Group(group_id=0, example_id=0, dispatch_version=0, episodes=eps)
    batch = build_train_batch(
        [g], step=0, seq_len=14, num_ranks=1, temperature=1.0, advantage_cfg=AdvantageConfig(),
        share_prefix=True,
    )  # fmt: skip
    plain = build_train_batch([g], step=0, seq_len=14, num_ranks=1, temperature=1.0,
                              advantage_cfg=AdvantageConfig())  # fmt: skip
    assert sorted(_unpacked_samples(batch)) == sorted(_unpacked_samples(plain))
    block_heads = [int(t) for mb in batch.micro_batches[0] for t in mb.input_ids[mb.position_ids == 0]]
    # each seat's prompt opens its own blocks; white's 10 + 5 + 3 tokens exceed 14: split in two units
    assert sorted(block_heads) == [1, 1, 9]
    assert batch.metrics["batch/packed_tokens"] < batch.metrics["batch/sample_tokens"]
    assert all(mb.num_tokens <= 14 for mb in batch.micro_batches[0])


def test_trainer_counts_every_trajectory_it_receives_shared_or_not():
    """`loss/num_samples` (the trainer's own count, summed over ranks) is the number of trajectories the
    batch holds, whether episodes are packed whole or as branches, with padding rows on a short rank."""
    from prime_async.trainer.packed_rows import samples_with_loss
    from prime_async.trainer.train import trained_samples
    from prime_async.transport.types import MicroBatch
    from prime_async.transport.zmq_batches import RankBatch

    rng = random.Random(4)
    groups = []
    for g in range(5):
        prompt = [rng.randint(1, 999) for _ in range(rng.randint(3, 20))]
        eps = [_shared_episode(rng, prompt, seat) for seat in ("a", "b") for _ in range(rng.randint(1, 4))]
        groups.append(Group(group_id=g, example_id=g, dispatch_version=0, episodes=eps))
    trajectories = sum(len(g.episodes) for g in groups)
    for share_prefix in (False, True):
        batch = build_train_batch(groups, step=0, seq_len=40, num_ranks=3, temperature=1.0,
                                  advantage_cfg=AdvantageConfig(), share_prefix=share_prefix)  # fmt: skip
        assert share_prefix == (batch.metrics["batch/packed_tokens"] < batch.metrics["batch/sample_tokens"])
        counts = [trained_samples(RankBatch.of(batch, rank)) for rank in range(3)]
        assert sum(counts) == trajectories, (share_prefix, counts)
    assert samples_with_loss(MicroBatch.padding()) == 0
