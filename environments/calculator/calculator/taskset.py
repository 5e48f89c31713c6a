"""The calculator taskset, its multi-turn env loop, the safe evaluator and the correctness reward."""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterable

import verifiers.v1 as vf

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. You may use a calculator: write <calc>EXPRESSION</calc> and the "
    "result comes back as <result>VALUE</result>. Finish with <answer>NUMBER</answer>."
)
_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_MAX_ABS = 10**12
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _eval_node(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_node(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
        if abs(value) > _MAX_ABS:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def evaluate(expression: str) -> int:
    """Exact integer value of `expression` (ints, + - *, unary minus, parentheses); ValueError otherwise."""
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    return _eval_node(tree.body)


def parse_calc(text: str) -> str | None:
    """The first calculator call in `text`, or None."""
    match = _CALC.search(text)
    return match.group(1) if match else None


def parse_answer(text: str) -> int | None:
    """The last `<answer>N</answer>` in `text`, or None."""
    found = _ANSWER.findall(text)
    return int(found[-1]) if found else None


def make_examples(*, num_examples: int, seed: int) -> list[tuple[str, int]]:
    """Deterministic (expression, value) pairs with 2-3 operands of up to three digits."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_examples):
        terms = [str(rng.randint(2, 999)) for _ in range(rng.randint(2, 3))]
        ops = [rng.choice("+-*") for _ in range(len(terms) - 1)]
        expr = terms[0] + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:], strict=True))
        out.append((expr, evaluate(expr)))
    return out


class CalculatorData(vf.TaskData):
    expression: str
    answer: int


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        return float(parse_answer(trace.last_reply) == task.answer)

    @vf.metric
    async def calculator_calls(self, trace: vf.Trace) -> float:
        return float(sum(1 for m in trace.assistant_messages if parse_calc(m.content or "") is not None))


class CalculatorTasksetConfig(vf.TasksetConfig):
    num_examples: int = 1000
    """How many examples `load()` yields."""
    seed: int = 0
    """Seed of the offline generator."""
    max_calls: int = 3
    """Calculator calls per episode; the model's reply after the last one is final."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorTasksetConfig]):
    def load(self) -> Iterable[CalculatorTask]:
        return [
            CalculatorTask(
                CalculatorData(
                    id=f"calc-{i}",
                    prompt=f"What is {expr}?",
                    system_prompt=SYSTEM_PROMPT,
                    expression=expr,
                    answer=value,
                ),
                self.config.task,
            )
            for i, (expr, value) in enumerate(
                make_examples(num_examples=self.config.num_examples, seed=self.config.seed)
            )
        ]


def calculator_result(expression: str) -> str:
    try:
        return f"<result>{evaluate(expression)}</result>"
    except ValueError as e:
        return f"<result>error: {e}</result>"


class CalculatorEnv(vf.Env[vf.SingleAgentEnvConfig]):
    """One agent; the env plays the calculator between its turns."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        max_calls = self.taskset.config.max_calls
        async with agents.agent.interaction(task) as exchange:
            segment = await exchange.turn()
            for _ in range(max_calls):
                expression = None if segment.terminated else parse_calc(segment.last_reply)
                if expression is None:
                    break
                segment = await exchange.turn(calculator_result(expression))
