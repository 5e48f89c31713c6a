"""The doctor's checks on hand-built probes: each one flags the fault it is for and passes clean input."""

from __future__ import annotations

from prime_async.doctor.checks import (
    Probe,
    episode_fits,
    mismatch_kl,
    prompt_fits,
    same_seed_same_reward,
    token_round_trip,
)
from prime_async.doctor.report import render
from prime_async.doctor.sync_run import k0_check
from prime_async.rollouts.gateway import GatewayCall
from prime_async.rollouts.types import Episode


def _call(prompt: list[int], out: list[int]) -> GatewayCall:
    return GatewayCall(prompt, out, [-0.5] * len(out), [0] * len(out), "stop", 0)


def _episode(tokens: list[int], sampled: set[int], reward: float = 1.0) -> Episode:
    mask = [i in sampled for i in range(len(tokens))]
    return Episode(
        example_id=0, token_ids=tokens, loss_mask=mask, sampler_logprobs=[-0.5 if m else 0.0 for m in mask],
        token_versions=[0 if m else -1 for m in mask], reward=reward,
    )  # fmt: skip


def two_turns(second_prompt: list[int]) -> Probe:
    """Turn 1: prompt [1, 2], sampled [3, 4]; turn 2: `second_prompt`, sampled [7]. The trained
    sequence is the exact extension [1, 2, 3, 4, 5, 6, 7]."""
    episode = _episode([1, 2, 3, 4, 5, 6, 7], {2, 3, 6})
    episode.metrics.update(sampled_turns=2, trained_turns=2, sampled_tokens=3)
    return Probe(0, [episode], [_call([1, 2], [3, 4]), _call(second_prompt, [7])])


def test_round_trip_passes_an_exact_extension_and_flags_a_retokenized_turn() -> None:
    exact = token_round_trip([two_turns([1, 2, 3, 4, 5, 6])])
    assert exact.passed is True and "2 of 2 sampled turns, 3 of 3 sampled tokens trained" in exact.detail
    # turn 2's prompt re-tokenized the first reply ([3, 4] -> [34]): the engine saw other tokens
    drift = token_round_trip([two_turns([1, 2, 34, 5, 6])])
    assert drift.passed is False and "turn 1" in drift.detail and "position 2" in drift.detail
    assert "token_exact" in drift.fix


def test_round_trip_flags_an_episode_split_into_branches() -> None:
    probe = two_turns([1, 2, 3, 4, 5, 6])
    probe.episodes[0].metrics["num_branches"] = 2
    assert token_round_trip([probe]).passed is False


def test_same_seed_flags_a_reward_that_differs_for_the_same_tokens() -> None:
    a, b = Probe(3, [_episode([1, 2, 3], {2}, 0.25)]), Probe(3, [_episode([1, 2, 3], {2}, 0.75)])
    result = same_seed_same_reward([(a, b)])
    assert result.passed is False and "0.25 then 0.75" in result.detail
    assert same_seed_same_reward([(a, a)]).passed is True
    other_tokens = Probe(3, [_episode([1, 2, 4], {2}, 0.75)])
    assert same_seed_same_reward([(a, other_tokens)]).passed is None  # the engine, not the env


def test_prompt_fits_names_the_seq_len_that_would_fit() -> None:
    probe = Probe(5, [_episode([1] * 50, {49})], [_call([1] * 49, [2])])
    assert prompt_fits([probe], seq_len=256, max_tokens=16).passed is True
    tight = prompt_fits([probe], seq_len=60, max_tokens=16)
    assert tight.passed is False and "seq_len to >= 65" in tight.fix and "max_tokens to 11" in tight.fix
    refused = Probe(6, [_episode([], set())])
    refused.episodes[0].metrics["env_error"] = "prompt_too_long"
    assert prompt_fits([refused], seq_len=60, max_tokens=16).passed is False


def test_episode_fits_measures_whole_episodes_not_first_prompts() -> None:
    """The tiny config's multi-turn case: the first prompt fits, turn 3's prompt (308 tokens) does not."""
    fits = two_turns([1, 2, 3, 4, 5, 6])
    result = episode_fits([fits], seq_len=256, max_tokens=16)
    assert result.passed is True and "longest episode 7 tokens (example 0" in result.detail
    over = Probe(4, [_episode([1] * 200, {150})], [_call([1] * 20, [2] * 30), _call([1] * 150, [2] * 50)])
    over.episodes[0].overlong = True
    over.episodes[0].metrics.update(overflow_turn=3, overflow_prompt_tokens=308, num_turns=2)
    assert prompt_fits([fits, over], seq_len=256, max_tokens=16).passed is True  # what it used to say
    result = episode_fits([fits, over], seq_len=256, max_tokens=16)
    assert result.passed is False
    assert (
        "1 of 2 episodes outgrew seq_len 256" in result.detail and "turn 3's prompt is 308" in result.detail
    )
    assert "longest episode 308 tokens (example 4, 2 turns)" in result.detail
    assert "raise seq_len to >= 324" in result.fix and "orchestrator.batch.sink.overlong" in result.fix
    refused = Probe(6, [_episode([], set())])
    refused.episodes[0].overlong = True
    refused.episodes[0].metrics.update(
        env_error="prompt_too_long", overflow_turn=1, overflow_prompt_tokens=90
    )
    assert episode_fits([refused], seq_len=60, max_tokens=16).passed is None  # prompt_fits' failure
    clamped = Probe(7, [_episode([1] * 60, {59})], [_call([1] * 50, [2] * 10)])
    clamped.episodes[0].overlong = True
    clamped.episodes[0].metrics.update(overflow_turn=1, overflow_prompt_tokens=50)
    assert episode_fits([clamped], seq_len=60, max_tokens=16).passed is None  # the first turn's, too


def test_mismatch_limit_and_k0_metrics() -> None:
    assert mismatch_kl(1e-7, 100).passed is True and mismatch_kl(0.02, 100).passed is False
    orch = [{"step": s, "rollout/data_staleness/max": 0.0} for s in range(3)]
    trainer = [{"step": s, "offpolicy/effective_steps/max": 0.0, "mismatch_kl": 1e-9} for s in range(3)]
    assert k0_check(orch, trainer, 3).passed is True
    stale = [*orch[:2], {"step": 2, "rollout/data_staleness/max": 1.0}]
    result = k0_check(stale, trainer, 3)
    assert result.passed is False and "[2]" in result.detail
    assert k0_check(orch, trainer[:1], 3).passed is False  # a run that stopped early


def test_report_lists_the_fix_of_each_failure() -> None:
    rows = [("env-a", mismatch_kl(0.02, 10)), ("env-a", mismatch_kl(1e-9, 10))]
    text = render(rows)
    assert "FAIL" in text and "pass" in text and "fix [env-a] engine vs trainer logprobs" in text
    assert text.endswith("doctor: 1 check(s) failed")


def _k0_rows(num_steps: int, distance: float, **trainer_extra: float) -> tuple[list[dict], list[dict]]:
    """Metric rows of a 3-step K = 0 run as `rl` logs them (the audit's S = 2 run: distance 1 by design,
    whole-batch mismatch_kl 4.8e-4 with lr 1e-4, the on-policy part at the engine/trainer mismatch)."""
    orch = [{"step": s, "rollout/data_staleness/max": 0.0, "rollout/buffer/dropped_stale": 0.0,
             "ledger/cancelled": 0.0} for s in range(3)]  # fmt: skip
    trainer = [
        {"step": s, "optim/num_steps": float(num_steps), "offpolicy/effective_steps/max": distance,
         "mismatch_kl": 4.8e-4, "mismatch_kl/on_policy": 2e-9, "offpolicy/on_policy_tokens": 120.0,
         "offpolicy/unknown_version_tokens": 0.0, **trainer_extra}
        for s in range(3)
    ]  # fmt: skip
    return orch, trainer


def test_k0_passes_two_steps_per_batch_and_fails_a_real_violation() -> None:
    orch, trainer = _k0_rows(num_steps=2, distance=1.0)
    result = k0_check(orch, trainer, 3)
    assert result.passed is True, result
    assert "distance <= 1" in result.detail
    # S = 2, a token of version n - 1 in the first mini-batch: (n - (n - 1)) * 2 + 0 = 2 > S - 1
    result = k0_check(*_k0_rows(num_steps=2, distance=2.0), 3)
    assert result.passed is False and "[0, 1, 2]" in result.detail and "report it" in result.fix
    # S = 1: distance 1 is a token of the previous version
    assert k0_check(*_k0_rows(num_steps=1, distance=1.0), 3).passed is False


def test_k0_judges_the_mismatch_on_tokens_trained_by_the_weights_that_sampled_them() -> None:
    orch, trainer = _k0_rows(num_steps=2, distance=1.0, mismatch_kl=5e-3)  # the update moved the 2nd half
    assert k0_check(orch, trainer, 3).passed is True
    orch, trainer = _k0_rows(num_steps=2, distance=1.0, **{"mismatch_kl/on_policy": 2e-3})
    result = k0_check(orch, trainer, 3)
    assert result.passed is False and "2.00e-03" in result.detail


def test_k0_reports_unknown_versions_and_stale_drops() -> None:
    orch, trainer = _k0_rows(num_steps=1, distance=0.0, **{"offpolicy/unknown_version_tokens": 7.0})
    result = k0_check(orch, trainer, 3)
    assert result.passed is False and "21 trained tokens carry no engine version" in result.detail  # 7 a step
    assert "round-trip" in result.fix
    orch, trainer = _k0_rows(num_steps=1, distance=0.0)
    orch[1]["rollout/buffer/dropped_stale"] = 2.0  # the sink hid them: data_staleness/max stays 0
    result = k0_check(orch, trainer, 3)
    assert result.passed is False and "2 groups dropped as stale (steps [1])" in result.detail
