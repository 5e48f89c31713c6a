"""Reward functions and data generators of the example environments vs hand-computed values, and
loading the environments by id through verifiers' real loaders."""

from __future__ import annotations

import asyncio

import pytest

vf = pytest.importorskip("verifiers.v1")

from calculator import evaluate, make_examples, parse_answer, parse_calc  # noqa: E402
from echo_text import make_examples as make_echo_texts  # noqa: E402
from echo_text import similarity  # noqa: E402
from reverse_text import lcs_ratio  # noqa: E402
from reverse_text import make_examples as make_texts  # noqa: E402
from reverse_text.taskset import lcs_length  # noqa: E402


@pytest.mark.parametrize(
    ("a", "b", "lcs"),
    [
        ("", "", 0),
        ("abc", "", 0),
        ("abc", "abc", 3),
        ("abcde", "ace", 3),
        ("abc", "def", 0),
        ("olleh", "hello", 2),
    ],
)
def test_lcs_length_by_hand(a: str, b: str, lcs: int) -> None:
    assert lcs_length(a, b) == lcs
    assert lcs_length(b, a) == lcs


def test_lcs_ratio_by_hand() -> None:
    assert lcs_ratio("dlrow", "dlrow") == 1.0
    assert lcs_ratio("", "dlrow") == 0.0
    assert lcs_ratio("", "") == 0.0
    assert lcs_ratio("abcde", "ace") == pytest.approx(2 * 3 / 8)  # LCS "ace"
    assert lcs_ratio("xyz", "abc") == 0.0
    assert lcs_ratio("dlrow olleh", "dlrow") == pytest.approx(2 * 5 / 16)


def test_reverse_text_data_is_deterministic_and_offline() -> None:
    a = make_texts(num_examples=50, seed=3)
    assert a == make_texts(num_examples=50, seed=3)
    assert a != make_texts(num_examples=50, seed=4)
    assert all(0 < len(t) <= 40 for t in a)


def test_echo_similarity_by_hand() -> None:
    assert similarity("go at tzi", "go at tzi") == 1.0
    assert similarity("", "") == 1.0  # difflib: two empty sequences match
    assert similarity("", "go") == 0.0
    assert similarity('"go at tzi"', "go at tzi") == pytest.approx(2 * 9 / 20)  # quotes cost 2 chars
    assert similarity("So in all.", "so in all") == pytest.approx(2 * 8 / 19)  # "o in all" matches
    assert similarity("abc", "xyz") == 0.0


def test_echo_text_data_is_deterministic_and_bounded() -> None:
    a = make_echo_texts(num_examples=60, seed=3)
    assert a == make_echo_texts(num_examples=60, seed=3)
    assert a != make_echo_texts(num_examples=60, seed=4)
    assert all(2 <= len(t.split()) <= 5 for t in a)  # 2-4 words + at most one random token
    one = make_echo_texts(num_examples=20, seed=1, min_words=1, max_words=1, random_token_p=0.0)
    assert all(len(t.split()) == 1 for t in one)
    with pytest.raises(ValueError, match="min_words"):
        make_echo_texts(num_examples=1, seed=0, min_words=3, max_words=2)


def test_calculator_evaluator_and_parsers() -> None:
    assert evaluate("12 * 3") == 36
    assert evaluate("(2 + 3) * -4") == -20
    assert evaluate("778 + 913 - 432") == 1259
    for bad in ("2 / 3", "__import__('os')", "2 ** 100", "1.5 + 1", "abc", "9" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)
    assert parse_calc("let me <calc>1 + 2</calc> then") == "1 + 2"
    assert parse_calc("no call") is None
    assert parse_answer("<answer>7</answer> ... <answer> -42 </answer>") == -42
    assert parse_answer("the answer is 7") is None
    examples = make_examples(num_examples=30, seed=1)
    assert examples == make_examples(num_examples=30, seed=1)
    assert all(evaluate(expr) == value for expr, value in examples)


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


def test_load_reverse_text_by_id_and_score() -> None:
    for env_id in ("reverse-text", "reverse_text"):
        env = _load(env_id, num_examples=7, seed=5)
        tasks = list(env.taskset)
        assert type(env.taskset).__name__ == "ReverseTextTaskset"
        assert [t.data.idx for t in tasks] == list(range(7))
        assert [t.data.text for t in tasks] == make_texts(num_examples=7, seed=5)
    task = tasks[0]
    exact = _trace_with_reply(task, task.data.text[::-1])
    asyncio.run(task.score(exact))
    assert exact.reward == 1.0
    half = _trace_with_reply(task, "")
    asyncio.run(task.score(half))
    assert half.reward == 0.0


def test_load_echo_text_by_id_and_score() -> None:
    for env_id in ("echo-text", "echo_text"):
        env = _load(env_id, num_examples=5, seed=2)
        tasks = list(env.taskset)
        assert type(env.taskset).__name__ == "EchoTextTaskset"
        assert [t.data.text for t in tasks] == make_echo_texts(num_examples=5, seed=2)
    task = tasks[0]
    assert task.data.text in task.data.prompt
    scores = {}
    replies = {"exact": f"  {task.data.text}\n", "quoted": f'"{task.data.text}"', "empty": ""}
    for name, reply in replies.items():
        trace = _trace_with_reply(task, reply)
        asyncio.run(task.score(trace))
        scores[name] = trace.reward
    assert scores["exact"] == 1.0 and scores["empty"] == 0.0
    assert scores["quoted"] == pytest.approx(similarity(f'"{task.data.text}"', task.data.text))
    with pytest.raises(ValueError, match="min_words"):
        _load("echo-text", min_words=4, max_words=2)


def test_load_calculator_by_id_and_score() -> None:
    env = _load("calculator", num_examples=4, seed=1, max_calls=2)
    assert type(env).__name__ == "CalculatorEnv"
    tasks = list(env.taskset)
    assert [(t.data.expression, t.data.answer) for t in tasks] == make_examples(num_examples=4, seed=1)
    task = tasks[0]
    right = _trace_with_reply(task, f"so <answer>{task.data.answer}</answer>")
    asyncio.run(task.score(right))
    assert right.reward == 1.0
    wrong = _trace_with_reply(task, f"<answer>{task.data.answer + 1}</answer>")
    asyncio.run(task.score(wrong))
    assert wrong.reward == 0.0
