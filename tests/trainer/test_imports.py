"""Import structure: no cycle in the trainer and orchestrator packages, and each trainer backend imports
alone without the loop.

The graph is read from the source with `ast` by `scripts/repo_figures.py` (every import statement, also
those inside functions), so a lazy import cannot hide a cycle; the backends are imported in fresh
interpreters.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import prime_async.orchestrator
import prime_async.trainer
from repo_graph import import_graph as package_import_graph

TRAINER = Path(prime_async.trainer.__file__).parent
PKG = "prime_async.trainer"


def import_graph(root: Path = TRAINER) -> dict[str, set[str]]:
    """module -> the modules of the package at `root` it imports (package parents are not edges)."""
    return package_import_graph(".".join(root.relative_to(root.parents[1]).parts))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_trainer_has_no_import_cycle() -> None:
    graph = import_graph()
    # the parser sees the real edges (a vacuous graph would pass trivially)
    assert f"{PKG}.fsdp" in graph[f"{PKG}.train"] and f"{PKG}.ckpt" in graph[f"{PKG}.fsdp"]
    assert f"{PKG}.megatron.backend" in graph[f"{PKG}.train"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_orchestrator_has_no_import_cycle() -> None:
    """Also type-only and function-level imports: `components` never imports the loop, `main` does."""
    graph = import_graph(Path(prime_async.orchestrator.__file__).parent)
    orch = "prime_async.orchestrator"
    assert f"{orch}.components" in graph[f"{orch}.orchestrator"]
    assert f"{orch}.orchestrator" in graph[f"{orch}.main"]
    assert f"{orch}.groups" in graph[f"{orch}.dispatcher"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_backends_never_import_the_loop() -> None:
    graph = import_graph()
    for backend in (f"{PKG}.fsdp", f"{PKG}.megatron.backend", f"{PKG}.backend"):
        assert f"{PKG}.train" not in graph[backend], backend


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        (f"{PKG}.fsdp", [f"{PKG}.train", f"{PKG}.megatron.backend", "megatron.core"]),
        (f"{PKG}.megatron.backend", [f"{PKG}.train", f"{PKG}.fsdp"]),
        (f"{PKG}.backend", [f"{PKG}.train", f"{PKG}.fsdp", f"{PKG}.megatron.backend"]),
        (f"{PKG}.train", [f"{PKG}.fsdp", f"{PKG}.megatron.backend"]),  # backends are built lazily
    ],
)
def test_module_imports_alone_in_a_fresh_interpreter(module: str, absent: list[str]) -> None:
    if module.startswith(f"{PKG}.megatron") and importlib.util.find_spec("megatron") is None:
        pytest.skip("needs the `megatron` extra")
    code = (
        f"import sys, {module}\n"
        f"loaded = [m for m in {absent!r} if m in sys.modules]\n"
        "assert not loaded, f'also imported: {loaded}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
