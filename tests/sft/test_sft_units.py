"""SFT pieces without a process: rendering masks, batches by step, the NLL loss, data sources, config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from prime_async.config.sft import SFTConfig, SFTDataConfig, SFTTasksetConfig
from prime_async.sft.batches import SFTBatches, usable_examples
from prime_async.sft.data import Chat, load_chats, taskset_chats
from prime_async.sft.render import ChatRenderer, Rendered
from prime_async.trainer.loss import nll_loss


def _chat(user: str, answer: str) -> Chat:
    return Chat(messages=[
        {"role": "system", "content": "Reverse the text."},
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ])  # fmt: skip


def test_render_trains_the_answer_and_its_stop_token_only(tiny_model_dir: Path) -> None:
    renderer = ChatRenderer(str(tiny_model_dir), ["assistant"])
    chat = _chat("abc def", "fed cba")
    out = renderer.render(chat)
    tok = renderer.tokenizer
    trained = tok.decode([t for t, m in zip(out.token_ids, out.loss_mask, strict=True) if m])
    first = out.loss_mask.index(True)
    # the untrained prefix is exactly what the engine is given at sampling time (prompt + generation header);
    # the trained rest is what the model samples there (Qwen3's empty think block included), not the newline
    # the template adds after the stop token
    prompt = renderer._renderer.render_ids(chat.messages[:2], add_generation_prompt=True)
    assert out.token_ids[:first] == prompt
    assert trained == tok.decode(out.token_ids[first:]).removesuffix("\n")
    assert trained.endswith("fed cba<|im_end|>") and "Reverse" not in trained
    # a multi-turn chat trains both assistant turns and no user turn
    turns = [*chat.messages, {"role": "user", "content": "again"}, {"role": "assistant", "content": "x"}]
    out2 = renderer.render(Chat(messages=turns))
    trained2 = tok.decode([t for t, m in zip(out2.token_ids, out2.loss_mask, strict=True) if m])
    assert trained2.startswith("fed cba<|im_end|>") and trained2.endswith("x<|im_end|>")
    assert "again" not in trained2 and "user" not in trained2


def _examples(n: int) -> list[Rendered]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = int(rng.integers(4, 30))
        mask = [False] * (length // 2) + [True] * (length - length // 2)
        out.append(Rendered(token_ids=[i] * length, loss_mask=mask))
    return out


def test_batches_are_a_function_of_the_step_and_cover_each_epoch() -> None:
    examples = _examples(20)
    a = SFTBatches(examples, batch_size=8, seed=3, seq_len=64, rank=0, world_size=2)
    b = SFTBatches(examples, batch_size=8, seed=3, seq_len=64, rank=0, world_size=2)
    for step in (4, 0, 2):  # any order: a resumed run asks for step n first
        x, y = a.train_batch(step), b.train_batch(step)
        assert [[mb.input_ids.tolist() for mb in r] for r in x.micro_batches] == [
            [mb.input_ids.tolist() for mb in r] for r in y.micro_batches
        ]
    # positions 0..39 over two epochs (20 examples, 8 per step): each epoch trains every example once
    seen = [ex.token_ids[0] for step in range(5) for ex in a.step_examples(step)]
    assert sorted(seen[:20]) == list(range(20)) and sorted(seen[20:40]) == list(range(20))
    assert seen[:20] != seen[20:40]  # each epoch has its own order
    batch = a.train_batch(1)
    assert len(batch.micro_batches[0]) == len(batch.micro_batches[1])  # ranks run the same passes
    for rank in batch.micro_batches:
        for mb in rank:
            assert mb.num_tokens <= 64 and not mb.loss_mask[mb.position_ids == 0].any()
    assert batch.num_loss_tokens == sum(sum(ex.loss_mask) for ex in a.step_examples(1))
    rank1 = SFTBatches(examples, batch_size=8, seed=3, seq_len=64, rank=1, world_size=2).receive(1)
    assert rank1.rank == 1 and rank1.layout == [[mb.num_tokens for mb in r] for r in batch.micro_batches]


def test_examples_that_do_not_fit_are_left_out_and_none_fitting_is_an_error() -> None:
    examples = [*_examples(3), Rendered(token_ids=[1] * 100, loss_mask=[False, *[True] * 99])]
    assert len(usable_examples(examples, seq_len=64)) == 3
    with pytest.raises(ValueError, match="no example fits seq_len = 2"):
        usable_examples(examples, seq_len=2)


def test_nll_loss_matches_a_hand_computed_value() -> None:
    logp = torch.tensor([-0.5, -1.0, -2.0, -0.25], requires_grad=True)
    mask = torch.tensor([False, True, True, True])
    out = nll_loss(logp=logp, sampler_logp=torch.zeros(4), advantages=torch.ones(4), loss_mask=mask,
                   num_loss_tokens=6)  # fmt: skip
    assert math.isclose(float(out.loss), (1.0 + 2.0 + 0.25) / 6, rel_tol=1e-6)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, -1 / 6, -1 / 6, -1 / 6]))
    assert not out.masked.any()


def test_jsonl_and_parquet_files_give_the_same_chats(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": _chat(f"t{i}", f"{i}t").messages} for i in range(3)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    from_jsonl = load_chats(SFTDataConfig(files=[tmp_path / "a.jsonl"]))
    from_parquet = load_chats(SFTDataConfig(files=[tmp_path / "a.parquet"]))
    assert from_jsonl == from_parquet and from_jsonl[2].messages[-1]["content"] == "2t"
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl row 1: needs a non-empty `messages` list"):
        load_chats(SFTDataConfig(files=[tmp_path / "bad.jsonl"]))


def test_taskset_reference_answers_become_the_assistant_turn() -> None:
    cfg = SFTTasksetConfig(id="echo-text", args={"num_examples": 3, "seed": 0}, answer_field="text")
    chats = taskset_chats(cfg)
    assert len(chats) == 3
    user, answer = chats[0].messages[-2], chats[0].messages[-1]
    assert answer["role"] == "assistant" and f'"{answer["content"]}"' in user["content"]
    with pytest.raises(ValueError, match="answer_field 'answer': 'echo-text' tasks have"):
        taskset_chats(SFTTasksetConfig(id="echo-text", args={"num_examples": 2}))


def test_config_refuses_what_sft_cannot_do(tmp_path: Path) -> None:
    data = {"files": [str(tmp_path / "a.jsonl")]}
    with pytest.raises(ValueError, match="exactly one of data"):
        SFTDataConfig(files=[tmp_path / "a.jsonl"], env=SFTTasksetConfig(id="echo-text"))
    with pytest.raises(ValueError, match="router_replay with sft"):
        SFTConfig(data=data, max_steps=2, router_replay=True)
    with pytest.raises(ValueError, match="'distributed' with sft"):
        SFTConfig(data=data, max_steps=2, weights={"transport": "distributed"})
    with pytest.raises(ValueError, match="loss: sft has no sampler"):
        SFTConfig(data=data, max_steps=2, loss={"type": "ppo_clip"})
    assert SFTConfig(data=data, max_steps=2, output_dir=tmp_path).final_model_dir == tmp_path / "final"
