"""Multi-agent, scripted-user and infinite verifiers environments through the real rollout source.

The example `word-chain` env (environments/word_chain) against the tiny model (`hf_engine`, teacher-
forced replies so rewards are known): a two-seat episode gives one trained trajectory per seat, each
with its own reward/tokens/masks/logprobs/versions; the scripted opponent gives one multi-turn
trajectory whose opponent turns are masked; the infinite taskset is streamed and resumes at the drawn
count; `env.config` reaches the env's own `vf.EnvConfig` and a wrong key is one line naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_engine import HFEngineClient
from test_episodes import check_alignment, model_logprobs, run_with_source

from prime_async.config.env import EnvConfig
from prime_async.engine_api import SamplingParams
from prime_async.orchestrator.data_source import DataSource
from prime_async.rollouts.tasks import LazyTasks
from prime_async.rollouts.verifiers_config import resolve_verifiers_config, verifiers_env_config
from prime_async.rollouts.verifiers_source import VerifiersRolloutSource

pytest.importorskip("verifiers.v1")

SAMPLING = SamplingParams(temperature=1.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngineClient:
    return HFEngineClient(model_dir=str(tiny_model_dir), version=5)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def force_word(engine: HFEngineClient, tokenizer: Any, word: str) -> list[int]:
    ids = [*tokenizer.encode(word, add_special_tokens=False), engine.model.config.eos_token_id]
    engine.force_next(ids)
    return ids


def test_seats_get_runner_defaults_and_user_overrides() -> None:
    raw = verifiers_env_config(EnvConfig(id="word-chain", config={"rounds": 1, "second": {"max_turns": 3}}))
    assert raw["first"] == {"runtime": {"type": "subprocess"}, "harness": {"id": "prime_async_chat"}}
    assert raw["second"]["max_turns"] == 3 and raw["second"]["harness"] == {"id": "prime_async_chat"}
    assert "agent" not in raw, "a two-seat env declares no `agent` field"
    config = resolve_verifiers_config(EnvConfig(id="word-chain", config={"rounds": 1}))
    assert type(config).__name__ == "WordChainEnvConfig" and config.rounds == 1
    single = verifiers_env_config(EnvConfig(id="reverse-text", runner="env_server"))
    assert single["agent"] == {"runtime": {"type": "subprocess"}, "harness": {"id": "null"}}


@pytest.mark.parametrize(
    ("env_cfg", "message"),
    [
        (EnvConfig(id="word-chain", config={"roundz": 2}), "orchestrator.env.config.roundz: unknown key"),
        (
            EnvConfig(id="word-chain", config={"first": {"max_turnz": 2}}),
            "orchestrator.env.config.first.max_turnz",
        ),
        (EnvConfig(id="word-chain", args={"sed": 2}), "orchestrator.env.args.sed: unknown key"),
        (
            EnvConfig(id="reverse-text", config={"taskset": {}}),
            "set the taskset's fields in orchestrator.env.args",
        ),
        (
            EnvConfig(id="no-such-env"),
            "orchestrator.env.id 'no-such-env': no installed environment has this id",
        ),
    ],
)
def test_wrong_key_is_one_line_naming_it(env_cfg: EnvConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        resolve_verifiers_config(env_cfg)
    assert "\n" not in str(info.value)


def test_two_seat_episode_trains_one_trajectory_per_seat(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    from word_chain import word_score

    async def body(source: VerifiersRolloutSource) -> Any:
        assert source.num_examples is None, "an infinite taskset is streamed"
        letter = source._tasks[4].data.letter
        first = force_word(engine, tokenizer, f"{letter}oat")  # a valid opening word
        second = force_word(engine, tokenizer, "zzz1")  # wrong letter, partly alphabetic
        result = await source.run_episode(example_id=4, engine_key="0", sampling=SAMPLING)
        return result, first, second

    env_cfg = EnvConfig(id="word-chain", config={"rounds": 1})
    (episodes, first_ids, second_ids) = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    assert isinstance(episodes, list) and sorted(e.seat for e in episodes) == ["first", "second"]
    by_seat = {e.seat: e for e in episodes}
    for ep, forced in ((by_seat["first"], first_ids), (by_seat["second"], second_ids)):
        assert ep.status == "ok", ep.error
        check_alignment(ep, version=5)
        assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == forced
        ref = model_logprobs(tiny_model_dir, ep.token_ids)
        for lp, want, m in zip(ep.sampler_logprobs, ref, ep.loss_mask, strict=True):
            if m:
                assert lp == pytest.approx(want, abs=1e-4)
    assert by_seat["first"].reward == 1.0
    assert by_seat["second"].reward == pytest.approx(word_score("zzz1", "t"))
    assert by_seat["second"].reward < 1.0


def test_scripted_opponent_is_one_multi_turn_trajectory(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    from word_chain import scripted_word, word_score

    async def body(source: VerifiersRolloutSource) -> Any:
        letter = source._tasks[0].data.letter
        force_word(engine, tokenizer, f"{letter}ent")
        force_word(engine, tokenizer, "xylophone")
        return await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING), letter

    env_cfg = EnvConfig(id="word-chain", config={"opponent": "script", "rounds": 2})
    ep, _letter = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    assert ep.status == "ok", ep.error
    assert ep.seat == "first" and ep.metrics["num_turns"] == 2
    check_alignment(ep, version=5)
    scripted = tokenizer.encode(scripted_word("t", 0), add_special_tokens=False)
    text_ids = ep.token_ids
    start = next(i for i in range(len(text_ids)) if text_ids[i : i + len(scripted)] == scripted)
    assert not any(ep.loss_mask[start : start + len(scripted)]), "the scripted user's turn is masked"
    # first word valid; the second answers "table" with an x-word: partial credit only
    assert ep.reward == pytest.approx(0.5 * (1.0 + word_score("xylophone", "e")))


def test_infinite_taskset_resumes_at_the_drawn_count(engine: HFEngineClient, tiny_model_dir: Path) -> None:
    """The data source's checkpoint of a streamed run + a fresh rollout source's lazy tasks give the
    same tasks, in the same order, as the uninterrupted run."""

    async def body(source: VerifiersRolloutSource) -> Any:
        data = DataSource(num_examples=source.num_examples, seed=0)
        drawn = [data.next_example()[0] for _ in range(6)]
        state = data.state_dict(pending=[(4, 0), (5, 0)])
        tasks = [source._tasks[i].data.letter for i in range(10)]
        return drawn, state, tasks

    env_cfg = EnvConfig(id="word-chain", args={"seed": 7})
    drawn, state, letters = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    assert drawn == list(range(6)) and state["position"] == 6

    async def resumed(source: VerifiersRolloutSource) -> Any:
        data = DataSource(num_examples=source.num_examples, seed=0)
        data.load_state_dict(state)
        ids = [data.next_example()[0] for _ in range(4)]
        assert isinstance(source._tasks, LazyTasks)
        return ids, [source._tasks[i].data.letter for i in ids], source._tasks.num_rewinds

    ids, resumed_letters, rewinds = run_with_source(env_cfg, [engine], tiny_model_dir, 512, resumed)
    assert ids == [4, 5, 6, 7]
    assert resumed_letters == letters[4:8] and rewinds == 0


def test_word_chain_scoring_and_deterministic_infinite_data() -> None:
    import itertools

    from word_chain import chain_score, make_letters, word_score

    assert word_score("Tiger.", "t") == 1.0 and word_score("tiger", "k") == 0.5
    assert word_score("", "t") == 0.0 and 0.0 < word_score("t1", "t") < 1.0
    prompt = "Your word must start with 'k'."
    convo = [
        ("system", "rules"),
        ("user", prompt),
        ("assistant", "kite"),
        ("user", "egg"),
        ("assistant", "gum"),
    ]
    assert chain_score(convo, "k", prompt) == 1.0  # kite answers k; gum answers egg's last letter
    assert chain_score([("assistant", "gum")], "k", None) == 0.5
    a = list(itertools.islice(make_letters(3), 50))
    assert a == list(itertools.islice(make_letters(3), 50)) and a != list(
        itertools.islice(make_letters(4), 50)
    )


def test_seat_without_a_turn_is_idle_not_an_error(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """`forfeit`: `first` opens with a move that does not parse, so `second` never acts. `first`'s
    trajectory trains as usual; `second`'s is idle (no model call, no token), not an error."""
    from word_chain import word_score

    async def body(source: VerifiersRolloutSource) -> Any:
        forced = force_word(engine, tokenizer, "42")  # not a word: first forfeits
        calls = len(engine.outputs)
        result = await source.run_episode(example_id=1, engine_key="0", sampling=SAMPLING)
        return result, forced, len(engine.outputs) - calls, source.metrics()

    env_cfg = EnvConfig(id="word-chain", config={"rounds": 2, "forfeit": True})
    episodes, forced, num_calls, metrics = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    assert num_calls == 1, "the game ended at the forfeit"
    by_seat = {e.seat: e for e in episodes}
    first, second = by_seat["first"], by_seat["second"]
    assert first.status == "ok", first.error
    check_alignment(first, version=5)
    assert [t for t, m in zip(first.token_ids, first.loss_mask, strict=True) if m] == forced
    assert first.reward == word_score("42", "x") == 0.0
    assert second.status == "idle" and second.error is None, second.error
    assert second.token_ids == second.loss_mask == second.sampler_logprobs == second.token_versions == []
    assert second.num_completion_tokens == 0 and "env_error" not in second.metrics
    assert metrics["env/episodes/idle"] == 1.0 and "env/errors/empty_completion" not in metrics
