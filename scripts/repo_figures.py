"""Print the repository's structure figures: lines per package, the package import graph, edges against the
layering, config classes and fields, README lines, and the hygiene figures of `scripts/hygiene_figures.py`
(functions over 60 lines, classes with more than 10 constructor parameters, getattr/hasattr on project
types, module cycles per package, config classes over 20 fields, loader lines, dead definitions).

    uv run python scripts/repo_figures.py            # the figures of this checkout
    uv run python scripts/repo_figures.py --edges    # every package edge, with the modules behind it

The layering is the one `docs/ARCHITECTURE.md` draws in its `layers` block (top to bottom); a package may
import only packages in its own layer or below. `tests/test_repository.py` asserts the same graph.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "prime_async"
PACKAGE = "prime_async"


@dataclass(frozen=True)
class ModuleImport:
    """One `import prime_async.x...` (module level or inside a function) from module `source`."""

    source: str  # dotted module name, e.g. "prime_async.eval.in_run"
    target: str  # dotted module name imported
    in_function: bool


Edges = dict[tuple[str, str], list[ModuleImport]]  # (from part, to part) -> the imports behind the edge


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def part_of(module: str) -> str:
    """The top-level part of `prime_async` a module belongs to ("orchestrator", "types", ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _resolve(node, module, is_package)
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(src: Path = SRC) -> list[ModuleImport]:
    """Every import of a `prime_async` module, by module; `if TYPE_CHECKING:` blocks count too (a type a
    module names is a dependency of its design even when it is not loaded at run time)."""
    known = {module_name(p, src) for p in src.rglob("*.py")}
    found: list[ModuleImport] = []
    for path in sorted(src.rglob("*.py")):
        module = module_name(path, src)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))

        _visit(tree, module, is_package, known, found, in_function=False)
    return found


def _visit(
    node: ast.AST,
    module: str,
    is_package: bool,
    known: set[str],
    found: list[ModuleImport],
    *,
    in_function: bool,
) -> None:
    for child in ast.iter_child_nodes(node):
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        for target in _targets(child, module, is_package):
            if target in known:
                found.append(ModuleImport(module, target, inner))
        _visit(child, module, is_package, known, found, in_function=inner)


def package_edges(imports: list[ModuleImport]) -> Edges:
    edges: dict[tuple[str, str], list[ModuleImport]] = defaultdict(list)
    for imp in imports:
        a, b = part_of(imp.source), part_of(imp.target)
        if a != b and b != "__init__":
            edges[(a, b)].append(imp)
    return dict(edges)


def declared_layers(architecture: Path = ROOT / "docs" / "ARCHITECTURE.md") -> list[list[str]]:
    """The layers, top first, from the ```layers fenced block of ARCHITECTURE.md: one line a layer,
    packages separated by spaces (a trailing `# comment` is ignored)."""
    text = architecture.read_text()
    match = re.search(r"```layers\n(.*?)```", text, re.DOTALL)
    if not match:
        raise SystemExit(f"{architecture} has no ```layers block")
    layers = []
    for line in match.group(1).splitlines():
        names = line.split("#")[0].split()
        if names:
            layers.append(names)
    return layers


def layer_index(layers: list[list[str]]) -> dict[str, int]:
    """Package -> rank; rank 0 is the top. A package may import packages of its own rank or higher."""
    return {name: rank for rank, names in enumerate(layers) for name in names}


def edges_against(edges: Edges, layers: list[list[str]]) -> list[tuple[str, str]]:
    rank = layer_index(layers)
    return sorted((a, b) for a, b in edges if rank.get(a, -1) > rank.get(b, -1))


def cycles(edges: Edges) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            strong(v)
    return found


def reachable_crossings(
    imports: list[ModuleImport], start: str, layers: list[list[str]]
) -> list[ModuleImport]:
    """Module imports against the layering among the modules reachable from `start` (what following that
    module's code, e.g. the orchestrator's config through the orchestrator, crosses)."""
    rank = layer_index(layers)
    by_source: dict[str, list[ModuleImport]] = defaultdict(list)
    for imp in imports:
        by_source[imp.source].append(imp)
    seen, todo, against = {start}, [start], []
    while todo:
        for imp in by_source[todo.pop()]:
            a, b = part_of(imp.source), part_of(imp.target)
            if a != b and rank.get(a, -1) > rank.get(b, -1):
                against.append(imp)
            if imp.target not in seen:
                seen.add(imp.target)
                todo.append(imp.target)
    return against


def lines_per_part(src: Path = SRC) -> dict[str, int]:
    lines: dict[str, int] = defaultdict(int)
    for path in src.rglob("*.py"):
        lines[part_of(module_name(path, src))] += len(path.read_text().splitlines())
    return dict(lines)


def config_classes(src: Path = SRC / "config") -> tuple[int, int]:
    """(classes, fields) of the pydantic config schema: classes deriving from a config base, and their
    annotated fields."""
    classes = fields = 0
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                (isinstance(b, ast.Name) and b.id.endswith(("Config", "Settings")))
                or (isinstance(b, ast.Name) and b.id == "BaseModel")
                for b in node.bases
            ):
                classes += 1
                fields += sum(
                    isinstance(s, ast.AnnAssign)
                    and isinstance(s.target, ast.Name)
                    and not s.target.id.startswith("_")
                    and "ClassVar" not in ast.unparse(s.annotation)
                    for s in node.body
                )
    return classes, fields


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--edges", action="store_true", help="list every package edge and its modules")
    args = parser.parse_args()
    imports = module_imports()
    edges = package_edges(imports)
    layers = declared_layers()
    lines = lines_per_part()
    total = sum(lines.values())
    print(f"{'part':<14}{'lines':>7}{'share':>8}")
    for part, n in sorted(lines.items(), key=lambda kv: -kv[1]):
        print(f"{part:<14}{n:>7}{n / total:>8.1%}")
    print(f"{'total':<14}{total:>7}")
    against = edges_against(edges, layers)
    print(f"\npackage edges: {len(edges)}; against the layering: {len(against)} {against}")
    print(f"cycles: {cycles(edges)}")
    crossings = reachable_crossings(imports, f"{PACKAGE}.orchestrator.main", layers)
    print(f"imports against the layering on the orchestrator's code path: {len(crossings)}")
    n_classes, n_fields = config_classes()
    print(f"config classes: {n_classes}, fields: {n_fields}")
    print(f"README.md lines: {len((ROOT / 'README.md').read_text().splitlines())}")
    print(f"function-level imports of prime_async modules: {sum(i.in_function for i in imports)}")
    import hygiene_figures  # beside this script; it imports this module's graph reader

    hygiene_figures.print_hygiene()
    if args.edges:
        for (a, b), imps in sorted(edges.items()):
            mods = sorted({f"{i.source} -> {i.target}" for i in imps})
            print(f"{a} -> {b} ({len(imps)}): " + "; ".join(mods[:6]) + (" ..." if len(mods) > 6 else ""))


if __name__ == "__main__":
    main()
