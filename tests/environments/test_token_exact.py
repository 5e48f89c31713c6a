"""Token-exact multi-turn episodes (token in, token out: `rollouts/token_bridge.py`).

Unit: the bridge keeps the sampled ids (non-canonical ones included) and appends the template's
rendering of the new messages only (the stop token not repeated, a cut reply closed, per-message
attribution); it declines when the template refuses the probe chat and uses the inner renderer's own
bridge first. Real (tiny model through the gateway, replies forced as non-canonical token sequences):
a multi-turn episode and a two-seat one are ONE branch each whose trained tokens are exactly what the
engine sampled on every turn; a rewritten history still splits and is counted (`history_rewritten`),
and without the bridge the same turns split as `template_rerender`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from hf_engine import HFEngineClient
from test_episodes import check_alignment, run_with_source

from prime_async.config.env import EnvConfig
from prime_async.engine_api import SamplingParams
from prime_async.rollouts import token_bridge
from prime_async.rollouts.episode import branch_split_causes
from prime_async.rollouts.gateway import Gateway
from prime_async.rollouts.verifiers_source import VerifiersRolloutSource

pytest.importorskip("verifiers.v1")

SAMPLING = SamplingParams(temperature=1.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngineClient:
    return HFEngineClient(model_dir=str(tiny_model_dir), version=3)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from renderers.base import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def make_renderer(tokenizer: Any, inner: dict[str, Any] | None = None) -> Any:
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer

    config = TypeAdapter(RendererConfig).validate_python(
        token_bridge.custom_config(inner or {"name": "default"})
    )
    return create_renderer(tokenizer, config)


def spelled(tokenizer: Any, word: str) -> list[int]:
    """`word` one character per token: a sequence the tokenizer would never produce for it."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in word]
    assert ids != tokenizer.encode(word, add_special_tokens=False), "the spelling must be non-canonical"
    return ids


def test_bridge_keeps_sampled_ids_and_appends_the_new_messages(tokenizer: Any) -> None:
    renderer = make_renderer(tokenizer)
    chat = [{"role": "system", "content": "rules"}, {"role": "user", "content": "Start with 't'."}]
    prompt = renderer.render_ids(chat, add_generation_prompt=True)
    eos = tokenizer.eos_token_id
    sampled = [*spelled(tokenizer, "then"), eos]
    new = [{"role": "user", "content": "table"}]
    bridged = renderer.bridge_to_next_turn(prompt, sampled, new)
    n = len(prompt) + len(sampled)
    assert bridged.token_ids[:n] == prompt + sampled, "a sampled reply is never re-tokenized"
    full = renderer.render_ids(
        [*chat, {"role": "assistant", "content": "then"}, *new], add_generation_prompt=True
    )
    canonical_reply = tokenizer.encode("then", add_special_tokens=False)
    # what follows the sampled reply is the template's own text after the reply (its close minus the
    # sampled stop token, the new user turn, the generation prompt), token for token
    after_reply = full[len(prompt) + len(canonical_reply) + 1 :]
    assert bridged.token_ids[n:] == after_reply
    assert tokenizer.decode(bridged.token_ids[n:]).startswith("\n<|im_start|>user\ntable<|im_end|>")
    assert set(bridged.message_indices[n:]) == {-1, 0} and bridged.message_indices[:n] == [-1] * n
    # a reply cut by max_tokens (no stop token) gets the template's close appended
    cut = renderer.bridge_to_next_turn(prompt, sampled[:-1], new)
    assert cut.token_ids[: n - 1] == prompt + sampled[:-1]
    assert cut.token_ids[n - 1 :] == [eos, *after_reply]


def test_bridge_attributes_each_new_message(tokenizer: Any) -> None:
    renderer = make_renderer(tokenizer)
    prompt = renderer.render_ids([{"role": "user", "content": "go"}], add_generation_prompt=True)
    sampled = [*spelled(tokenizer, "them"), tokenizer.eos_token_id]
    new = [{"role": "tool", "content": "42", "tool_call_id": "c0"}, {"role": "user", "content": "and?"}]
    bridged = renderer.bridge_to_next_turn(prompt, sampled, new)
    tail = bridged.token_ids[len(prompt) + len(sampled) :]
    indices = bridged.message_indices[len(prompt) + len(sampled) :]
    tool_text = tokenizer.decode([t for t, i in zip(tail, indices, strict=True) if i == 0])
    user_text = tokenizer.decode([t for t, i in zip(tail, indices, strict=True) if i == 1])
    assert "<tool_response>\n42\n</tool_response>" in tool_text and "and?" not in tool_text
    assert user_text.startswith("<|im_start|>user\nand?") and indices[-1] == -1


def test_qwen3_thinking_of_an_earlier_turn_stays_as_sampled(tokenizer: Any) -> None:
    """The tiny model's renderer is `qwen3`, whose template drops an earlier turn's thinking at a new user
    message (its own bridge declines there): the bridge keeps the sampled thinking in the context."""
    renderer = make_renderer(tokenizer, {"name": "qwen3"})
    chat = [{"role": "user", "content": "Start with 't'."}]
    prompt = renderer.render_ids(chat, add_generation_prompt=True)
    sampled = [
        *tokenizer.encode("<think>\nhmm\n</think>\n\nthen", add_special_tokens=False),
        tokenizer.eos_token_id,
    ]
    new = [{"role": "user", "content": "nest"}]
    assert renderer.inner.bridge_to_next_turn(prompt, sampled, new) is None, "qwen3 re-renders here"
    bridged = renderer.bridge_to_next_turn(prompt, sampled, new)
    assert bridged.token_ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert tokenizer.decode(bridged.token_ids[len(prompt) + len(sampled) :]).startswith(
        "\n<|im_start|>user\nnest"
    )
    reply = {"role": "assistant", "content": "then", "reasoning_content": "hmm"}
    fresh = tokenizer.decode(renderer.render_ids([*chat, reply, *new], add_generation_prompt=True))
    assert "hmm" not in fresh, "the template alone would have dropped the sampled thinking"


class _Inner:
    """An inner renderer stub: its own bridge answer, and a template that refuses the probe chat."""

    def __init__(self, bridged: Any) -> None:
        self.bridged = bridged

    def bridge_to_next_turn(self, *args: Any, **kwargs: Any) -> Any:
        return self.bridged

    def render_ids(self, *args: Any, **kwargs: Any) -> list[int]:
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    def get_stop_token_ids(self) -> list[int]:
        return []


def test_inner_bridge_first_and_a_refusing_template_declines(tokenizer: Any) -> None:
    renderer = make_renderer(tokenizer)
    renderer._inner = _Inner(bridged="the inner renderer's bridge")
    assert renderer.bridge_to_next_turn([1], [2], [{"role": "user", "content": "x"}]) == (
        "the inner renderer's bridge"
    )
    renderer._inner = _Inner(bridged=None)
    assert renderer.bridge_to_next_turn([1], [2], [{"role": "user", "content": "x"}]) is None


def force(engine: HFEngineClient, ids: list[int]) -> list[int]:
    engine.force_next(ids)
    return ids


def test_multi_turn_episode_trains_every_turn_as_sampled(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    """word-chain against its scripted opponent, three turns, every reply non-canonical: one branch whose
    loss-masked tokens are exactly the three sampled replies (stop tokens included)."""
    eos = tokenizer.eos_token_id

    async def body(source: VerifiersRolloutSource) -> Any:
        forced = [force(engine, [*spelled(tokenizer, w), eos]) for w in ("then", "nest", "tin")]
        episode = await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING)
        return episode, forced, source.metrics()

    env_cfg = EnvConfig(id="word-chain", config={"opponent": "script", "rounds": 3})
    ep, forced, metrics = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    assert ep.status == "ok", ep.error
    assert ep.metrics["num_branches"] == 1 and ep.metrics["num_turns"] == 3
    assert ep.metrics["sampled_turns"] == ep.metrics["trained_turns"] == 3
    assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == [
        t for ids in forced for t in ids
    ]
    assert sum(ep.loss_mask) == ep.metrics["sampled_tokens"]
    check_alignment(ep, version=3)
    assert not any(k.startswith("env/branch_splits/") for k in metrics)
    assert metrics["env/untrained_sampled_tokens"] == 0


def test_every_seat_of_a_two_seat_episode_is_one_branch(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    eos = tokenizer.eos_token_id

    async def body(source: VerifiersRolloutSource) -> Any:
        words = ("then", "nest", "test", "tin")  # first, second, first, second
        forced = [force(engine, [*spelled(tokenizer, w), eos]) for w in words]
        return await source.run_episode(example_id=0, engine_key="0", sampling=SAMPLING), forced

    env_cfg = EnvConfig(id="word-chain", config={"rounds": 2})
    episodes, forced = run_with_source(env_cfg, [engine], tiny_model_dir, 512, body)
    by_seat = {e.seat: e for e in episodes}
    for seat, replies in (("first", forced[0::2]), ("second", forced[1::2])):
        ep = by_seat[seat]
        assert ep.status == "ok", ep.error
        assert ep.metrics["num_branches"] == 1 and ep.metrics["trained_turns"] == 2
        assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == [
            t for ids in replies for t in ids
        ]
        check_alignment(ep, version=3)


async def _three_turns(
    engine: HFEngineClient, tokenizer: Any, model_dir: Path, renderer: dict[str, Any], *, rewrite: bool
) -> Any:
    """Three chat turns through verifiers' train client and the gateway, the way its interception
    server runs them (prepare the turn on the trace, get the response, commit); with `rewrite`, the
    env edits the first user message before the third turn. The trace's branches."""
    import verifiers.v1 as vf
    from verifiers.v1 import graph
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import SamplingConfig

    async with Gateway(engines=[engine], seq_len=512) as gateway:
        session = gateway.open_session(engine_key="0")
        config = vf.TrainClientConfig(
            base_url=f"{gateway.base_url}/v1", api_key_var="UNUSED", renderer=renderer,
            renderer_model_name=str(model_dir),
        )  # fmt: skip
        client, dialect = TrainClient(config), ChatDialect()
        trace = Trace(
            task=TraceTask(type="t", data=vf.TaskData(id="x")), agent=AgentInfo(config=vf.AgentConfig())
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        for k, (word, answer) in enumerate((("then", "table"), ("eel", "garden"), ("gum", "moon"))):
            body = {"model": session.key, "messages": messages}
            request = dialect.parse_request(body)
            turn = graph.prepare_turn(trace, request.messages, request.tools)
            force(engine, [*spelled(tokenizer, word), tokenizer.eos_token_id])
            response = await client.get_response(dialect, body, SamplingConfig(max_tokens=8), turn=turn)
            turn.commit(response)
            messages = [*messages, {"role": "assistant", "content": response.message.content}]
            messages.append({"role": "user", "content": answer})
            if rewrite and k == 1:
                messages[0] = {"role": "user", "content": "hello again"}
        await client.close()
        return trace.branches


def test_history_rewrite_still_splits_and_is_counted(
    engine: HFEngineClient, tokenizer: Any, tiny_model_dir: Path
) -> None:
    exact = token_bridge.custom_config({"name": "default"})
    branches = asyncio.run(_three_turns(engine, tokenizer, tiny_model_dir, exact, rewrite=False))
    assert len(branches) == 1 and branch_split_causes(branches) == []
    branches = asyncio.run(_three_turns(engine, tokenizer, tiny_model_dir, exact, rewrite=True))
    assert branch_split_causes(branches) == ["history_rewritten"]
    # without the bridge every turn renders the chat afresh: the spelled replies are re-tokenized
    branches = asyncio.run(
        _three_turns(engine, tokenizer, tiny_model_dir, {"name": "default"}, rewrite=False)
    )
    assert branch_split_causes(branches) == ["template_rerender", "template_rerender"]


def test_custom_config_names_an_importable_renderer() -> None:
    from renderers.custom import load_custom_renderer

    config = token_bridge.custom_config({"name": "qwen3"})
    assert config["inner"] == {"name": "qwen3"}
    assert load_custom_renderer(config["import_path"]) is token_bridge.TokenExactRenderer
    assert "prime_async.rollouts.token_bridge" in sys.modules
