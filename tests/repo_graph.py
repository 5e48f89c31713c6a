"""`scripts/repo_figures.py` as a module for the tests: the one AST reader of the package import graph
(`test_repository.py` checks the layers with it, `trainer/test_imports.py` the cycles inside packages)."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


@cache
def repo_figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("repo_figures", ROOT / "scripts" / "repo_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@cache
def hygiene_figures() -> ModuleType:
    """`scripts/hygiene_figures.py` (it imports `repo_figures`, loaded first under that name)."""
    repo_figures()
    spec = importlib.util.spec_from_file_location("hygiene_figures", ROOT / "scripts" / "hygiene_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` (e.g. "prime_async.trainer") it imports, at module level or
    inside functions; a module's own parent packages are not edges."""
    figures = repo_figures()
    prefix = package + "."
    modules = {figures.module_name(p) for p in figures.SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules if m == package or m.startswith(prefix)}
    for imp in figures.module_imports():
        inside = imp.source in graph and imp.target in graph and imp.target != imp.source
        if inside and not imp.source.startswith(imp.target + "."):
            graph[imp.source].add(imp.target)
    return graph
