"""The feature-interaction matrix (`cells.py`), run for real: every trained cell is a whole `rl` run on
the tiny model (three or four processes, real HTTP, ZeroMQ, verifiers environments) that must pass
`cells.check_trained` (its ledger against the trainer's own count and the episode log, staleness per
token, no waste outside kill cells, distillation and route replay where on, a kill survived as the only
restart, nothing left running, images in vlm cells, an elastic engine joined and left); every refused
pair must be refused by the `rl` command itself before anything starts: exit 2, one line that names both
keys.

Cells run MATRIX_WORKERS (default 2) at a time: a cell's cost is mostly process start-up, which leaves the
cores idle part of the time. With MATRIX_RESULTS set (scripts/feature_matrix.py), each cell's outcome
(trained, failed, refused) is written there as JSON for the docs table."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from cells import (
    DIMENSIONS,
    TIE,
    CellRun,
    cell_id,
    check_trained,
    refused_pairs,
    run_cell,
    run_refused,
    trained_cells,
    untied_pairs,
)

TRAINED = [dict(cell) for cell in trained_cells()]
REFUSED = list(refused_pairs())


def _record(name: str, outcome: dict) -> None:
    results = os.environ.get("MATRIX_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"{name}.json").write_text(json.dumps(outcome))


@pytest.fixture(scope="session")
def cell_runs(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[CellRun]]]:
    """The selected cells' runs, started in test order on MATRIX_WORKERS threads (one `rl` each)."""
    selected = [
        item.callspec.params["cell"]
        for item in request.session.items
        if item.originalname == "test_cell_trains" and not item.get_closest_marker("skip")  # no CUDA for it
    ]
    workers = int(os.environ.get("MATRIX_WORKERS", "2"))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="matrix-cell") as pool:
        yield {
            cell_id(cell): pool.submit(
                run_cell, cell, tmp_path_factory.mktemp("cell"), model_dir=tiny_model_dir, timeout_s=540
            )
            for cell in selected
        }


@pytest.mark.timeout(1200)  # its own run (<= 540 s) after at most MATRIX_WORKERS - 1 others
@pytest.mark.parametrize(
    "cell",
    # a cell with N trainer processes needs N CUDA devices when CUDA is visible (tests/conftest.py)
    [pytest.param(c, id=cell_id(c), marks=pytest.mark.needs_devices(c["trainer_procs"])) for c in TRAINED],
)
def test_cell_trains(cell: dict, cell_runs: dict[str, Future[CellRun]]) -> None:
    try:
        figures = check_trained(cell_runs[cell_id(cell)].result())
    except Exception as e:  # recorded as failed (the docs table must not show it trained), then raised
        _record(cell_id(cell), {"cell": cell, "outcome": "failed", "error": str(e)[:500]})
        raise
    _record(cell_id(cell), {"cell": cell, "outcome": "trained", **figures})


@pytest.mark.parametrize("pair", REFUSED, ids=[p.label for p in REFUSED])
def test_pair_is_refused_at_start(pair, tmp_path: Path) -> None:
    proc = run_refused(pair.cell, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, f"a refusal is one line: {lines}"
    for key in (pair.a[0], pair.b[0]):
        words = [w for d in _tied_with(key) for w in KEY_WORDS[d]]
        assert any(word in lines[0] for word in words), f"{key} not named: {lines[0]}"
    assert not (tmp_path / "run" / "logs").exists(), "nothing was started"
    _record(pair.label, {"cell": pair.cell, "outcome": "refused", "message": lines[0]})


# how a refusal line names each dimension's config key
KEY_WORDS = {
    "env": ("envs", "env"), "kill": ("restart.max_restarts", "max_restarts"),
    "k": ("max_off_policy_steps",), "pause_mode": ("pause_mode",), "eval": ("eval",),
    "weights": ("weights.transport",), "lora": ("lora",), "envs": ("envs",),
    "deterministic": ("deterministic",), "interval": ("weights.update_interval", "update_interval"),
    "granularity": ("submission_granularity",), "trainer_procs": ("num_processes",),
    "moe": ("router_replay",), "teacher": ("teacher",), "curve": ("transport.curve",),
    "probe": ("weights.probe",), "stop_on_alarm": ("stop_on_alarm",),
    "model": ("model.build", "model.path"), "elastic": ("rl-engines",),
}  # fmt: skip


def _tied_with(key: str) -> tuple[str, ...]:
    """`key` and, for a dimension of the TIE, its partner (a refusal of env = image_shapes names the VLM)."""
    tie = [d for d, _ in TIE]
    return tuple(tie) if key in tie else (key,)


def test_every_pair_is_trained_or_refused() -> None:
    """The covering property: each pair of values of two options is in a trained cell or refused, but
    the pairs that break the TIE (not crossed)."""
    covered = {(a, b) for cell in trained_cells() for a in cell for b in cell if a != b}
    refused = {(p.a, p.b) for p in REFUSED} | set(untied_pairs())
    names = list(DIMENSIONS)
    for i, d1 in enumerate(names):
        for d2 in names[i + 1 :]:
            for v1 in DIMENSIONS[d1]:
                for v2 in DIMENSIONS[d2]:
                    pair = ((d1, v1), (d2, v2))
                    assert pair in covered or pair in refused, f"{pair} is neither trained nor refused"
