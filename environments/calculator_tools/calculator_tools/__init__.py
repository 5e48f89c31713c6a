"""calculator-tools: arithmetic with a calculator MCP tool (verifiers v1 `Toolset` + `@vf.tool`).

Loaded by id (`calculator-tools`); exports one `vf.Taskset` in `__all__`. Each task declares a
task-scoped `CalculatorToolset` (`Task.toolsets`); its tool calls and results are harness turns the
policy never samples, so verifiers' trace masks them out of the loss.

Invariants: data is generated offline and deterministically from `seed` (the `calculator` env's
generator); the reward is 1.0 iff the final `<answer>N</answer>` equals the exact integer value of the
expression; the tool evaluates integer `+ - *` and parentheses only (never `eval`) and counts its calls
in the rollout's state (`tool_calls`, read by the `tool_calls` metric).
"""

from __future__ import annotations

from calculator_tools.taskset import (
    CalculatorToolsData,
    CalculatorToolsState,
    CalculatorToolsTask,
    CalculatorToolsTaskset,
)
from calculator_tools.tool import CalculatorToolset

__all__ = [
    "CalculatorToolsData",
    "CalculatorToolsState",
    "CalculatorToolsTask",
    "CalculatorToolsTaskset",
    "CalculatorToolset",
]
