"""calculator: multi-turn arithmetic with a calculator tool (verifiers v1 Taskset + Env, offline data).

The model may call the calculator by writing `<calc>EXPR</calc>`; the environment evaluates EXPR and
answers with a `<result>...</result>` turn, until the model answers `<answer>N</answer>` (or the call
budget is spent). Calculator calls and results are environment turns: the policy never samples them, so
verifiers' trace marks them unsampled and they are masked out of the loss.

Loaded by id (`calculator`); exports one `vf.Taskset` and its `vf.Env` in `__all__`.

Invariants: data is generated offline and deterministically from `seed`; the reward is 1.0 iff the
final answer equals the exact integer value of the expression, else 0.0; the calculator only evaluates
integer `+ - *` and parentheses (never `eval`), and refuses anything else with an error result.
"""

from __future__ import annotations

from calculator.taskset import (
    CalculatorEnv,
    CalculatorTask,
    CalculatorTaskset,
    evaluate,
    make_examples,
    parse_answer,
    parse_calc,
)

__all__ = [
    "CalculatorEnv",
    "CalculatorTask",
    "CalculatorTaskset",
    "evaluate",
    "make_examples",
    "parse_answer",
    "parse_calc",
]
