"""On-policy distillation: the loss against a hand-computed value (orchestrator batch -> wire -> trainer
term -> loss), and the teacher's logprobs aligned with the sampled tokens on a real engine."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from prime_async.config.orchestrator import AdvantageConfig, TeacherConfig
from prime_async.config.trainer import MaskLossConfig
from prime_async.inference.client import HttpEngineClient
from prime_async.orchestrator.batching import build_train_batch
from prime_async.orchestrator.types import Group
from prime_async.rollouts.teacher import TeacherScorer, TeacherUnavailable
from prime_async.rollouts.types import Episode
from prime_async.trainer.loss import build_loss_fn
from prime_async.trainer.opd import apply_teacher_advantage
from prime_async.transport.wire import decode_rank_slice, encode_rank_slice
from prime_async.transport.zmq_batches import RankBatch
from proc_helpers import start_embedded_engine

TEACHER = TeacherConfig(base_urls=["http://127.0.0.1:1"], kl_weight=0.5, env_weight=2.0)


def _episode(reward: float, sampler: list[float], teacher: list[float]) -> Episode:
    n = len(sampler)
    return Episode(
        example_id=0, token_ids=list(range(1, 3 + n)), loss_mask=[False, False] + [True] * n,
        sampler_logprobs=[0.0, 0.0, *sampler], token_versions=[-1, -1] + [0] * n, reward=reward,
        teacher_logprobs=[0.0, 0.0, *teacher],
    )  # fmt: skip


def _received(batch) -> RankBatch:
    """The batch as the trainer receives it: through the wire encoding."""
    header, mbs = decode_rank_slice([bytes(f) for f in encode_rank_slice(batch, 0)], max_frame_bytes=1 << 20)
    return RankBatch(step=header.step, rank=0, micro_batches=mbs, layout=header.layout,
                     num_loss_tokens=header.num_loss_tokens, temperature=header.temperature,
                     min_dispatch_version=0, teacher_kl_weight=header.teacher_kl_weight)  # fmt: skip


def test_opd_loss_matches_a_hand_computed_value() -> None:
    a = _episode(1.0, [-0.5, -1.0], [-0.25, -3.0])
    b = _episode(0.0, [-2.0], [-1.0])
    group = Group(group_id=0, example_id=0, dispatch_version=0, episodes=[a, b])
    batch = build_train_batch([group], step=0, seq_len=64, num_ranks=1, temperature=1.0,
                              advantage_cfg=AdvantageConfig(), teacher=TEACHER)  # fmt: skip
    # reverse KL estimate: mean of sampler - teacher over the 3 loss tokens
    assert math.isclose(batch.metrics["opd/reverse_kl"], ((-0.25) + 2.0 + (-1.0)) / 3, rel_tol=1e-6)
    received = apply_teacher_advantage(_received(batch))
    # env advantages 0.5 / -0.5 (group mean 0.5), scaled by env_weight 2; + 0.5 * (teacher - sampler)
    expected = {
        (-0.5, -0.25): 1.0 + 0.5 * 0.25,
        (-1.0, -3.0): 1.0 + 0.5 * -2.0,
        (-2.0, -1.0): -1.0 + 0.5 * 1.0,
    }
    logp, adv, mask = [], [], []
    for mb in received.micro_batches:
        for s, t, m, got in zip(
            mb.sampler_logprobs, mb.teacher_logprobs, mb.loss_mask, mb.advantages, strict=True
        ):
            if m:
                assert math.isclose(got, expected[(float(s), float(t))], rel_tol=1e-6)
            else:
                assert got == 0.0
        logp.append(mb.sampler_logprobs)
        adv.append(mb.advantages)
        mask.append(mb.loss_mask)
    # on-policy (logp = sampler logp): the mask loss is -sum(A_t) / N and its gradient -A_t / N
    loss_fn = build_loss_fn(MaskLossConfig())
    sampler, advantages = torch.tensor(np.concatenate(logp)), torch.tensor(np.concatenate(adv))
    lp = sampler.clone().requires_grad_(True)
    out = loss_fn(logp=lp, sampler_logp=sampler, advantages=advantages,
                  loss_mask=torch.tensor(np.concatenate(mask)), num_loss_tokens=3)  # fmt: skip
    assert math.isclose(float(out.loss), -sum(expected.values()) / 3, rel_tol=1e-6)
    out.loss.backward()
    assert math.isclose(float(lp.grad.sum()), -sum(expected.values()) / 3, rel_tol=1e-6)


def test_without_a_teacher_the_batch_is_unchanged_and_bad_teacher_values_are_refused() -> None:
    group = Group(group_id=0, example_id=0, dispatch_version=0,
                  episodes=[_episode(1.0, [-0.5], [-1.0]), _episode(0.0, [-0.5], [-1.0])])  # fmt: skip
    plain = _received(build_train_batch([group], step=0, seq_len=64, num_ranks=1, temperature=1.0,
                                        advantage_cfg=AdvantageConfig()))  # fmt: skip
    assert plain.teacher_kl_weight == 0 and apply_teacher_advantage(plain) is plain
    assert all(mb.teacher_logprobs is None for mb in plain.micro_batches)
    group.episodes[0].teacher_logprobs[2] = float("nan")
    batch = build_train_batch([group], step=0, seq_len=64, num_ranks=1, temperature=1.0,
                              advantage_cfg=AdvantageConfig(), teacher=TEACHER)  # fmt: skip
    with pytest.raises(ValueError, match="teacher_logprobs is NaN/inf on a loss token"):
        apply_teacher_advantage(_received(batch))


@pytest.mark.timeout(300)
def test_teacher_logprobs_align_with_the_sampled_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The teacher serving the student's own weights scores every sampled token with the logprob the
    sampler reported for it (reverse KL 0); non-loss positions get 0; a dead teacher is waited out up to
    outage_timeout_s, then fails naming its URL, and leaves the episode unscored (never trained as is)."""
    config = (  # float32 stated: "auto" is bfloat16 on CUDA, where prefill and decode differ by ~1e-2
        f'backend = "torch"\nseq_len = 256\noutput_dir = "{tmp_path}"\n[model]\npath = "{tiny_model_dir}"\n'
        'dtype = "float32"\n'
    )
    url, proc = start_embedded_engine(config, tmp_path, timeout_s=300)
    try:
        episodes = asyncio.run(_sample_and_score(url))
    finally:
        proc.terminate()
        proc.wait(30)
    scored, (unscored, dead_error) = episodes
    for ep in scored:
        assert ep.status == "ok" and len(ep.teacher_logprobs) == len(ep.token_ids)
        for s, t, m in zip(ep.sampler_logprobs, ep.teacher_logprobs, ep.loss_mask, strict=True):
            assert abs(s - t) < 1e-4 if m else t == 0.0
    assert unscored.teacher_logprobs is None
    assert "http://127.0.0.1:1" in dead_error and "orchestrator.teacher.outage_timeout_s = 1" in dead_error


async def _sample_and_score(url: str) -> tuple[list[Episode], tuple[Episode, str]]:
    async with HttpEngineClient(url) as client:
        episodes = []
        for i in range(3):  # two turns: prompt, sampled reply, a user turn, sampled reply
            prompt, reply1 = [5 + i, 6, 7], await client.generate([5 + i, 6, 7], {"max_new_tokens": 6})
            user = [11, 12]
            context = prompt + reply1.output_ids + user
            reply2 = await client.generate(context, {"max_new_tokens": 5})
            ids = context + reply2.output_ids
            mask = (
                [False] * 3 + [True] * len(reply1.output_ids) + [False] * 2 + [True] * len(reply2.output_ids)
            )
            lps = [0.0] * 3 + reply1.output_logprobs + [0.0] * 2 + reply2.output_logprobs
            episodes.append(Episode(example_id=i, token_ids=ids, loss_mask=mask, sampler_logprobs=lps,
                                    token_versions=[0] * len(ids)))  # fmt: skip
    scorer = TeacherScorer(
        TeacherConfig(base_urls=[url], batch_episodes=2), temperature=1.0, deterministic=False
    )
    await scorer.score(episodes)
    metrics = scorer.metrics()
    assert (
        metrics["teacher/requests"] == 2
        and metrics["teacher/episodes"] == 3
        and metrics["teacher/errors"] == 0
    )
    await scorer.aclose()
    dead = TeacherScorer(TeacherConfig(base_urls=["http://127.0.0.1:1"], timeout_s=5, outage_timeout_s=1),
                         temperature=1.0, deterministic=True)  # fmt: skip
    unscored = Episode(example_id=9, token_ids=[1, 2, 3], loss_mask=[False, True, True],
                       sampler_logprobs=[0.0, -1.0, -1.0], token_versions=[0, 0, 0])  # fmt: skip
    with pytest.raises(TeacherUnavailable) as info:
        await dead.score([unscored])
    await dead.aclose()
    return episodes, (unscored, str(info.value))
