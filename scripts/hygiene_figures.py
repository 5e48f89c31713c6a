"""The hygiene figures of issue 38, read from the source with `ast` (printed by `scripts/repo_figures.py`).

- functions over 60 lines (`def` line to last line; decorators not counted), in src/;
- classes with more than 10 constructor parameters: an explicit `__init__`'s parameters (not `self`, `*args`,
  `**kwargs`), else a dataclass's or NamedTuple's fields (`field(init=False)` and ClassVar excluded; fields
  of project dataclass bases included). Pydantic config models are excluded (their fields are the next
  figure);
- getattr/hasattr on project types, a heuristic: a `getattr`/`hasattr` call is counted when its attribute
  name is a string literal naming an attribute defined on a project class (a method, a class-level field,
  or a `self.x = ...` in a method; dunders excluded), or when its object is `self`/`cls` or a parameter
  annotated with a project class (a computed name is marked: often a loop over a model's declared fields);
- module cycles per package: strongly connected components of the module import graph inside each
  package; every import counts, at module level, under `if TYPE_CHECKING:` and inside functions (a lazy
  import cannot hide a cycle, as in `tests/trainer/test_imports.py`); the count with module-level imports
  only is printed beside it; a module importing its own parent package is not an edge;
- config classes over 20 fields: pydantic config schemas in src/prime_async/config with more than 20
  annotated fields of their own;
- loader lines: the lines of `LOADER_FILES`, the config loading and CLI code;
- dead definitions: module-level functions, classes and assigned names, and methods called by name (see
  `_methods`), in src/ that no other code names.
  A name counts as used when it is read (a `Name`, an attribute, an import) in a .py file of src/, tests/,
  scripts/ or environments/, or appears as a word in a non-docstring string there, or in a .toml file of
  those directories or pyproject.toml (entry points). It is matched by name: a homonym elsewhere keeps a
  definition alive, so the list is a lower bound.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from repo_figures import ROOT, SRC, cycles, module_imports, module_name, part_of

MAX_FUNCTION_LINES = 60
MAX_CONSTRUCTOR_PARAMS = 10
MAX_CONFIG_FIELDS = 20
# Config loading and CLI code: the files `parse_config` runs through, from argv and TOML to a validated model
# (base.py whole: its loading part is the `shorthands` the loader expands). The cli_* files were folded into
# loader.py by issue 38 (pydantic-settings); they stay listed so the figure compares across commits (a file
# that is not there counts nothing).
LOADER_FILES = (
    "config/loader.py",
    "config/cli_args.py",
    "config/cli_help.py",
    "config/cli_schema.py",
    "config/dicts.py",
    "config/base.py",
)
USE_DIRS = ("src", "tests", "scripts", "environments")
# Names a module defines for the interpreter or a tool rather than for other code.
IMPLICIT_USES = frozenset({"__all__", "__version__", "logger", "main", "__getattr__", "__dir__"})
PYDANTIC_ROOTS = frozenset({"BaseModel", "BaseSettings"})


@dataclass(frozen=True)
class Finding:
    """One place in src/: `where` is `path:line`, relative to the repository root."""

    where: str
    name: str
    size: int = 0

    def __str__(self) -> str:
        return f"{self.where} {self.name}" + (f" ({self.size})" if self.size else "")


def _sources(src: Path = SRC) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(src.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"


def long_functions(src: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> list[Finding]:
    """Functions and methods longer than `limit` lines."""
    found = []
    for path, tree in _sources(src):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    found.append(Finding(_where(path, node), node.name, n))
    return found


def _classes(src: Path = SRC) -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    by_name: dict[str, list[tuple[Path, ast.ClassDef]]] = defaultdict(list)
    for path, tree in _sources(src):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                by_name[node.name].append((path, node))
    return dict(by_name)


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(target, ast.Name):
            names.append(target.id)
        elif isinstance(target, ast.Attribute):
            names.append(target.attr)
    return names


def _is_pydantic(node: ast.ClassDef, classes: dict, seen: frozenset[str] = frozenset()) -> bool:
    for base in _base_names(node):
        if base in PYDANTIC_ROOTS:
            return True
        parents = classes.get(base, []) if base not in seen else []
        if any(_is_pydantic(c, classes, seen | {base}) for _, c in parents):
            return True
    return False


def _decorator_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _is_init_field(stmt: ast.stmt) -> bool:
    if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
        return False
    if "ClassVar" in ast.unparse(stmt.annotation):
        return False
    value = stmt.value
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
        return not any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in value.keywords
        )
    return True


def _field_count(node: ast.ClassDef, classes: dict, seen: frozenset[str] = frozenset()) -> int:
    own = sum(_is_init_field(s) for s in node.body)
    inherited = 0
    for base in _base_names(node):
        if base in classes and base not in seen:
            _, parent = classes[base][0]
            if "dataclass" in _decorator_names(parent):
                inherited += _field_count(parent, classes, seen | {base})
    return own + inherited


def constructor_params(node: ast.ClassDef, classes: dict) -> int | None:
    """Parameters of the class's own constructor; None when it declares none (inherits one)."""
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            a = stmt.args
            return len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
    if "dataclass" in _decorator_names(node) or "NamedTuple" in _base_names(node):
        return _field_count(node, classes)
    return None


def wide_classes(src: Path = SRC, limit: int = MAX_CONSTRUCTOR_PARAMS) -> list[Finding]:
    """Classes (pydantic config models excluded) whose constructor takes more than `limit` parameters."""
    classes = _classes(src)
    found = []
    for entries in classes.values():
        for path, node in entries:
            if _is_pydantic(node, classes):
                continue
            n = constructor_params(node, classes)
            if n is not None and n > limit:
                found.append(Finding(_where(path, node), node.name, n))
    return sorted(found, key=lambda f: f.where)


def project_attributes(classes: dict) -> set[str]:
    """Every non-dunder attribute name a project class defines: methods, class-level names, `self.x = `."""
    names: set[str] = set()
    for entries in classes.values():
        for _, node in entries:
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(stmt.target.id)
                elif isinstance(stmt, ast.Assign):
                    names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            for sub in ast.walk(node):
                stored = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                if stored and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def _project_typed_params(func: ast.AST | None, class_names: set[str]) -> set[str]:
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    a = func.args
    typed = {"self", "cls"}
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
        if arg.annotation is not None:
            words = set(re.findall(r"\w+", ast.unparse(arg.annotation)))
            if words & class_names:
                typed.add(arg.arg)
    return typed


def _calls_with_scope(tree: ast.Module) -> Iterator[tuple[ast.Call, ast.AST | None]]:
    """Every getattr/hasattr call, with the function around it (None at module level)."""

    def visit(node: ast.AST, func: ast.AST | None) -> Iterator[tuple[ast.Call, ast.AST | None]]:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            named = isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
            if named and child.func.id in ("getattr", "hasattr") and len(child.args) >= 2:
                yield child, inner
            yield from visit(child, inner)

    yield from visit(tree, None)


def project_side_doors(src: Path = SRC) -> list[Finding]:
    """getattr/hasattr calls on project types, by the heuristic of the module docstring."""
    classes = _classes(src)
    attributes = project_attributes(classes)
    class_names = set(classes)
    found = []
    for path, tree in _sources(src):
        for call, func in _calls_with_scope(tree):
            obj, name = call.args[0], call.args[1]
            literal = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
            typed = isinstance(obj, ast.Name) and obj.id in _project_typed_params(func, class_names)
            if typed or (literal is not None and literal in attributes):
                kind = "" if literal is not None else "  [computed name]"
                found.append(Finding(_where(path, call), ast.unparse(call) + kind))
    return found


def package_module_cycles(src: Path = SRC, *, lazy: bool = True) -> dict[str, list[list[str]]]:
    """package -> the module cycles inside it, for every package of src/ (`lazy`: count imports inside
    functions too)."""
    graph: dict[str, dict[tuple[str, str], list]] = defaultdict(dict)
    for imp in module_imports(src):
        into_parent = imp.source == imp.target or imp.source.startswith(imp.target + ".")
        if into_parent or (imp.in_function and not lazy):
            continue
        package = part_of(imp.source)
        if part_of(imp.target) == package:
            graph[package][(imp.source, imp.target)] = []
    packages = {part_of(module_name(p, src)) for p in src.glob("*/__init__.py")}
    packages |= {p.name for p in src.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    return {package: cycles(graph.get(package, {})) for package in sorted(packages)}


def big_configs(src: Path = SRC / "config", limit: int = MAX_CONFIG_FIELDS) -> list[Finding]:
    """Pydantic config classes with more than `limit` annotated fields of their own."""
    classes = _classes(src)
    found = []
    for entries in classes.values():
        for path, node in entries:
            if _is_pydantic(node, classes):
                n = sum(
                    isinstance(s, ast.AnnAssign)
                    and isinstance(s.target, ast.Name)
                    and not s.target.id.startswith("_")
                    and "ClassVar" not in ast.unparse(s.annotation)
                    for s in node.body
                )
                if n > limit:
                    found.append(Finding(_where(path, node), node.name, n))
    return sorted(found, key=lambda f: f.where)


def loader_lines(src: Path = SRC) -> dict[str, int]:
    """Lines of each file of `LOADER_FILES` that exists."""
    return {f: len((src / f).read_text().splitlines()) for f in LOADER_FILES if (src / f).is_file()}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def used_names(root: Path = ROOT) -> set[str]:
    """Every name the code of `USE_DIRS` reads, plus the words of its strings and TOML files."""
    used: set[str] = set()
    files = [p for d in USE_DIRS for p in (root / d).rglob("*") if p.suffix in (".py", ".toml")]
    for path in [*files, root / "pyproject.toml"]:
        if ".venv" in path.parts or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".toml":
            used.update(re.findall(r"\w+", text))
            continue
        tree = ast.parse(text)
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.update(node.name.split("."))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                used.update(re.findall(r"\w+", node.value))
    return used


def _top_level_names(tree: ast.Module) -> Iterator[tuple[ast.stmt, str]]:
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield stmt, stmt.name
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    yield stmt, target.id
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            yield stmt, stmt.target.id


def _methods(tree: ast.Module) -> Iterator[tuple[ast.stmt, str]]:
    """Methods of module-level classes that code calls by name: not dunders, and no decorator but
    property/staticmethod/classmethod (a validator or a registered hook is called by its framework)."""
    plain = {"property", "staticmethod", "classmethod"}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            method = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            if (
                method
                and not stmt.name.startswith("__")
                and {ast.unparse(d) for d in stmt.decorator_list} <= plain
            ):
                yield stmt, f"{cls.name}.{stmt.name}"


def dead_definitions(src: Path = SRC, root: Path = ROOT) -> list[Finding]:
    """Module-level definitions and methods of src/ no code names (see the module docstring)."""
    used = used_names(root)
    found = []
    for path, tree in _sources(src):
        for stmt, name in [*_top_level_names(tree), *_methods(tree)]:
            if name.split(".")[-1] not in used and name not in IMPLICIT_USES:
                found.append(Finding(_where(path, stmt), name))
    return found


def _listed(title: str, findings: list[Finding]) -> None:
    print(f"\n{title}: {len(findings)}")
    for f in findings:
        print(f"  {f}")


def print_hygiene() -> None:
    """Print the figures of the module docstring."""
    _listed(f"functions over {MAX_FUNCTION_LINES} lines (lines)", long_functions())
    _listed(
        f"classes with more than {MAX_CONSTRUCTOR_PARAMS} constructor parameters (dataclass fields count; "
        "pydantic config models excluded)",
        wide_classes(),
    )
    _listed("getattr/hasattr on project types (heuristic: scripts/hygiene_figures.py)", project_side_doors())
    found = package_module_cycles()
    eager = sum(len(c) for c in package_module_cycles(lazy=False).values())
    total = sum(len(c) for c in found.values())
    print(f"\nmodule cycles per package (all imports): {total} (module-level imports only: {eager})")
    for package, comps in found.items():
        print(f"  {package}: {len(comps)}" + "".join(f"\n    {' <-> '.join(c)}" for c in comps))
    _listed(f"config classes over {MAX_CONFIG_FIELDS} fields (own fields)", big_configs())
    lines = loader_lines()
    print(f"\nloader lines (config loading + CLI): {sum(lines.values())}")
    for f, n in lines.items():
        print(f"  {f}: {n}")
    where = "src/ tests/ scripts/ environments/"
    _listed(f"dead definitions (module-level and methods, named nowhere in {where})", dead_definitions())
