"""The compute-bound long-tail environment (echo_long): seeded data whose word count is heavy-tailed, its
reward and metrics, and loading it by id through verifiers' real loaders. No model."""

from __future__ import annotations

import asyncio
import random

import pytest

vf = pytest.importorskip("verifiers.v1")

from echo_long import make_examples, similarity, word_count  # noqa: E402


def test_data_is_deterministic_offline_and_bounded() -> None:
    a = make_examples(num_examples=200, seed=3)
    assert a == make_examples(num_examples=200, seed=3)
    assert a != make_examples(num_examples=200, seed=4)
    assert all(3 <= len(t.split()) <= 60 for t in a)
    short = make_examples(num_examples=50, seed=1, min_words=2, max_words=2)
    assert all(len(t.split()) == 2 for t in short)
    with pytest.raises(ValueError, match="min_words"):
        make_examples(num_examples=1, seed=0, min_words=5, max_words=4)
    with pytest.raises(ValueError, match="length_alpha"):
        make_examples(num_examples=1, seed=0, length_alpha=0.0)


def test_word_count_is_heavy_tailed() -> None:
    words = sorted(len(t.split()) for t in make_examples(num_examples=1000, seed=0))
    p50, p90 = words[500], words[900]
    assert p50 <= 5 and p90 >= 3 * p50  # most texts are a few words
    assert words[-1] == 60 and words[-1] >= 8 * p50  # a few are 10-20x longer (cut at max_words)
    assert 5 <= words.count(60) <= 50  # P(>= 60 words) = (3 / 60) ** 1.3 = 2%
    rng = random.Random(0)
    light = sorted(word_count(rng, min_words=3, max_words=60, alpha=4.0) for _ in range(1000))
    assert light[990] < words[990]  # a larger alpha is a lighter tail


def test_similarity_by_hand() -> None:
    assert similarity("go at tzi", "go at tzi") == 1.0
    assert similarity("", "go") == 0.0
    assert similarity('"go at tzi"', "go at tzi") == pytest.approx(2 * 9 / 20)  # quotes cost 2 chars
    long = max(make_examples(num_examples=1000, seed=0), key=len).split()  # 60 words, 285 characters
    one_word_off = " ".join([*long[:30], "oops", *long[31:]])
    assert similarity(one_word_off, " ".join(long)) > 0.95  # difflib's autojunk would score it ~0.5


def _trace_with_reply(task: vf.Task, reply: str) -> vf.Trace:
    trace = vf.Trace(task=vf.TraceTask(type="t", data=task.data), agent=vf.AgentInfo(config=vf.AgentConfig()))
    trace.root_reply = reply
    return trace


def _load(env_id: str, **args: object) -> vf.Env:
    config = vf.resolve_env_config(
        {
            "taskset": {"id": env_id, **args},
            "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": "null"}},
        }
    )
    return vf.load_environment(config)


def test_load_by_id_and_score() -> None:
    for env_id in ("echo-long", "echo_long"):
        env = _load(env_id, num_examples=20, seed=2)
        tasks = list(env.taskset)
        assert type(env.taskset).__name__ == "EchoLongTaskset"
        assert [t.data.text for t in tasks] == make_examples(num_examples=20, seed=2)
    task = max(tasks, key=lambda t: len(t.data.text))
    assert task.data.prompt == f'Repeat this text: "{task.data.text}"'
    replies = {
        "exact": f"  {task.data.text}\n",
        "quoted": f'"{task.data.text}"',
        "truncated": " ".join(task.data.text.split()[:-1]),
        "empty": "",
    }
    traces = {name: _trace_with_reply(task, reply) for name, reply in replies.items()}
    for trace in traces.values():
        asyncio.run(task.score(trace))
    assert traces["exact"].reward == 1.0 and traces["exact"].metrics["exact"] == 1.0
    assert traces["empty"].reward == 0.0
    for name in ("quoted", "truncated"):
        assert 0.0 < traces[name].reward < 1.0 and traces[name].metrics["exact"] == 0.0
    assert traces["exact"].metrics["words"] == len(task.data.text.split())
    with pytest.raises(ValueError, match="min_words"):
        _load("echo-long", min_words=8, max_words=4)
