"""Reward functions and data generators of the example environments vs hand-computed values, and
loading both environments by id through verifiers' real loaders."""

from __future__ import annotations

import asyncio

import pytest

vf = pytest.importorskip("verifiers.v1")

from calculator import evaluate, make_examples, parse_answer, parse_calc  # noqa: E402
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
