"""Repository hygiene: the project is self-contained and its test doubles stay out of the runtime.

- no tracked text file refers to `../shared` (a directory outside the repository that a clone lacks);
- no runtime module imports `prime_async.testing` (simulators and synthetic data are for tests/benches);
- the pause-mode literals are spelled out once, in `prime_async/types.py`;
- the package import graph is layered as `docs/ARCHITECTURE.md` draws it (its ```layers block): no
  package imports one of a higher layer, no cycle, every package has a layer, `orchestrator/` stays
  under 15% of the code;
- no module import cycle inside any package (imports inside functions count too);
- docs/ARCHITECTURE.md names every module of src/prime_async (by path, or by name on its package's line);
- `ruff check` and `ruff format --check` pass on the whole repository (the style the project keeps).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from repo_graph import hygiene_figures, repo_figures

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "prime_async"


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_tracked_file_refers_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary (images, lock data): cannot hold a readable reference
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if "../shared" in line:
                offenders.append(f"{path.relative_to(ROOT)}:{i}")
    assert not offenders, f"files refer to ../shared (outside the repository): {offenders}"


def test_runtime_never_imports_the_testing_package():
    pattern = re.compile(r"^\s*(from|import)\s+prime_async\.testing\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in SRC.rglob("*.py")
        if "testing" not in p.relative_to(SRC).parts and pattern.search(p.read_text())
    ]
    assert not offenders, f"runtime modules import prime_async.testing: {offenders}"


def test_pause_mode_literals_are_defined_once():
    pattern = re.compile(r"Literal\[[^\]]*\"(retract|in_place|drain)\"")
    places = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert places == ["types.py"], f"pause-mode literals spelled out in {places}; import prime_async.types"


def test_package_imports_follow_the_documented_layers():
    figures = repo_figures()
    imports = figures.module_imports()
    edges = figures.package_edges(imports)
    layers = figures.declared_layers()
    ranked = figures.layer_index(layers)
    parts = {figures.part_of(i.source) for i in imports} | set(figures.lines_per_part()) - {"__init__"}
    assert not parts - set(ranked), f"packages without a layer in docs/ARCHITECTURE.md: {parts - set(ranked)}"
    against = {
        edge: sorted({f"{i.source} -> {i.target}" for i in edges[edge]})
        for edge in figures.edges_against(edges, layers)
    }
    assert not against, f"imports against the layering of docs/ARCHITECTURE.md: {against}"
    assert figures.cycles(edges) == [], f"package import cycles: {figures.cycles(edges)}"


def test_the_orchestrator_stays_a_small_part_of_the_code():
    lines = repo_figures().lines_per_part()
    share = lines["orchestrator"] / sum(lines.values())
    assert share < 0.15, f"orchestrator/ is {share:.1%} of the code; move what is not the run loop below it"


def test_no_module_cycle_in_any_package():
    found = hygiene_figures().package_module_cycles()
    assert "orchestrator" in found and "trainer" in found, "the package list misses packages"
    cyclic = {p: [" <-> ".join(c) for c in comps] for p, comps in found.items() if comps}
    assert not cyclic, f"module import cycles inside packages: {cyclic}"


def _doc_lines(doc: Path) -> list[str]:
    """The doc's lines, brace lists expanded (`entrypoints/{rl,sft}.py` -> `entrypoints/rl.py
    entrypoints/sft.py`)."""
    expand = re.compile(r"([\w/]*)\{([\w,]+)\}(\.py)")
    return [
        expand.sub(lambda m: " ".join(f"{m[1]}{n}{m[3]}" for n in m[2].split(",")), line)
        for line in doc.read_text().splitlines()
    ]


def modules_not_named(doc: Path) -> list[str]:
    """Modules of src/prime_async (`__init__.py` aside) the doc does not name. A module is named by its path
    below src/prime_async on some line, or by its file name (`carry.py`) or bare name in backticks
    (`` `carry` ``) on a line that also names its package (`orchestrator`)."""
    lines = _doc_lines(doc)
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if path.name == "__init__.py":
            continue
        short = re.compile(rf"(?<![\w/]){re.escape(path.stem)}\.py|`{re.escape(path.stem)}`")
        package = rel.parent.name
        if not any(
            str(rel) in line or (package and package in line and short.search(line)) for line in lines
        ):
            missing.append(str(rel))
    return missing


def test_architecture_names_every_module():
    missing = modules_not_named(ROOT / "docs" / "ARCHITECTURE.md")
    assert not missing, f"docs/ARCHITECTURE.md does not name these modules of src/prime_async: {missing}"


def test_ruff_check_and_format_are_clean():
    ruff = Path(sys.executable).parent / "ruff"
    for args in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([str(ruff), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-1000:]}"
