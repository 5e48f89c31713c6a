"""docs/feature-matrix.md is generated (scripts/feature_matrix.py), never hand-edited: its rows are
exactly the cells and refused pairs `cells.py` generates today, and every trained cell's outcome there is
`trained`, or `not run` when the table was rendered from a partial run (`--results`, after the cells
changed): never `failed` (a failing cell must be fixed or refused, not documented)."""

from __future__ import annotations

from pathlib import Path

from cells import DIMENSIONS, refused_pairs, table_values, trained_cells

DOC = Path(__file__).resolve().parents[2] / "docs" / "feature-matrix.md"
OUTCOMES = ("trained", "not run")


def test_docs_table_lists_the_generated_cells() -> None:
    text = DOC.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| env")]
    trained = [r for r in rows if not r.startswith("| `") and not r.startswith("| pair")]
    refused = [r for r in rows if r.startswith("| `")]
    assert len(trained) == len(trained_cells()), "re-run scripts/feature_matrix.py: the cells changed"
    assert [r.split("`")[1] for r in refused] == [p.label for p in refused_pairs()]
    for row, cell in zip(trained, trained_cells(), strict=True):
        cols = [c.strip() for c in row.strip("|").split("|")]
        assert len(cols) == len(DIMENSIONS) + 3
        assert cols[len(DIMENSIONS)] in OUTCOMES, f"a cell that does not train is documented: {row}"
        assert cols[: len(DIMENSIONS)] == table_values(dict(cell)), f"re-run scripts/feature_matrix.py: {row}"
