"""The calculator-tools taskset: tasks that declare the calculator toolset, and their reward."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf
from calculator import make_examples, parse_answer

from calculator_tools.tool import CalculatorToolset, CalculatorToolsState

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. You may call the calculator tool with an expression. "
    "Finish with <answer>NUMBER</answer>."
)


class CalculatorToolsData(vf.TaskData):
    expression: str
    answer: int


class CalculatorToolsTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    """Where the calculator server runs (verifiers' `ToolsetConfig`: runtime, url, colocated)."""


class CalculatorToolsTask(vf.Task[CalculatorToolsData, CalculatorToolsState, CalculatorToolsTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalculatorToolsTaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    @vf.reward
    async def correct(self, task: CalculatorToolsData, trace: vf.Trace) -> float:
        return float(parse_answer(trace.last_reply) == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(trace.state.tool_calls)


class CalculatorToolsConfig(vf.TasksetConfig):
    num_examples: int = 1000
    """How many examples `load()` yields."""
    seed: int = 0
    """Seed of the offline generator."""
    task: CalculatorToolsTaskConfig = CalculatorToolsTaskConfig()


class CalculatorToolsTaskset(vf.Taskset[CalculatorToolsTask, CalculatorToolsConfig]):
    def load(self) -> Iterable[CalculatorToolsTask]:
        return [
            CalculatorToolsTask(
                CalculatorToolsData(
                    id=f"calc-tools-{i}",
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
