"""The calculator tool server: a `vf.Toolset` whose `calculate` tool evaluates integer arithmetic.

Runnable as `python -m calculator_tools.tool` (how verifiers starts a task-scoped server per rollout).
"""

from __future__ import annotations

import verifiers.v1 as vf
from calculator import evaluate


class CalculatorToolsState(vf.State):
    tool_calls: int = 0
    """Calculator calls made in this rollout (synced with the rollout's trace state)."""


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig, CalculatorToolsState]):
    TOOL_PREFIX = "calculator"

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression with + - * and parentheses; returns its value."""
        self.state.tool_calls += 1
        try:
            return str(evaluate(expression))
        except ValueError as e:
            return f"error: {e}"


if __name__ == "__main__":
    CalculatorToolset.run()
