"""Plan validation (`plan/validate.py`, `scripts/validate_plan.py`): the recommended candidate is measured
as well as the config as given, with its knobs in place of the user's, and the measured steady state is
read the way the simulation counts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_plan import run_dir  # noqa: F401  (the fixture: a K = 1 run with known timings)

from prime_async.plan.candidates import Candidate, Prediction, candidate_grid, predict
from prime_async.plan.profile import WARMUP_STEPS, read_profile
from prime_async.plan.run import run_config
from prime_async.plan.validate import Comparison, candidate_argv, mean_staleness, measure, to_validate


def _orchestrator_rows(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True)
    (path / "orchestrator.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_measure_reads_the_steady_state_by_trained_group(tmp_path: Path) -> None:
    warm = {"time/step": 9.0, "rollout/trained_groups": 4.0, "rollout/data_staleness/ratio_0": 1.0}
    rows = [{"step": s, **warm} for s in range(WARMUP_STEPS)]
    rows += [
        {"step": WARMUP_STEPS, "time/step": 1.0, "rollout/trained_groups": 4.0,
         "rollout/data_staleness/ratio_0": 0.5, "rollout/data_staleness/ratio_1": 0.5},
        {"step": WARMUP_STEPS + 1, "time/step": 2.0, "rollout/trained_groups": 2.0,
         "rollout/data_staleness/ratio_0": 0.0, "rollout/data_staleness/ratio_1": 1.0},
    ]  # fmt: skip
    _orchestrator_rows(tmp_path / "metrics", rows)
    m = measure(tmp_path)
    assert m.steps == 2 and m.step_time_s == pytest.approx(1.5)
    assert m.staleness == pytest.approx({0: 2 / 6, 1: 4 / 6})  # groups, not steps, weigh the same
    assert mean_staleness(m.staleness) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match=r"orchestrator\.jsonl: no step after the first"):
        measure(tmp_path, warmup=10)


def test_the_recommended_candidate_is_validated_with_its_own_flags(run_dir: Path) -> None:  # noqa: F811
    cfg, profile = run_config(run_dir), read_profile(run_dir)
    predictions = [predict(cfg, profile, cand) for cand in candidate_grid(cfg)]
    runs = to_validate(predictions)
    assert runs[0][0] == "as given" and runs[0][1].candidate.current
    best = runs[-1][1].candidate
    # the profile's K = 1 with a 2-group buffer is generation-bound: the plan recommends another setting
    assert [label for label, _ in runs] == ["as given", "recommended"] and not best.current
    user = [
        "@",
        "rl.toml",
        "--orchestrator.max-off-policy-steps",
        "3",
        "--orchestrator.admission.max_buffered_groups=9",
    ]
    argv = candidate_argv(user, best)
    assert argv[:2] == ["@", "rl.toml"] and "3" not in argv and not any("=9" in a for a in argv)
    assert argv[2:] == best.flags().split()
    # the config as given, recommended: validated once
    only = [p for p in predictions if p.candidate.current]
    assert [label for label, _ in to_validate(only)] == ["as given"]


def test_comparison_reports_step_and_staleness_errors(tmp_path: Path) -> None:
    cand = Candidate(k=1, max_inflight_groups=2, max_buffered_groups=4, engines=1)
    prediction = Prediction(cand, step_time_s=1.1, staleness={0: 0.25, 1: 0.75})
    row = {"time/step": 1.0, "rollout/trained_groups": 2.0, "rollout/data_staleness/ratio_1": 1.0}
    rows = [{"step": s, **row} for s in range(WARMUP_STEPS + 2)]
    _orchestrator_rows(tmp_path / "metrics", rows)
    c = Comparison("recommended", prediction, measure(tmp_path))
    assert c.step_error == pytest.approx(0.1) and c.staleness_error == pytest.approx(-0.25)
    assert c.row("tiny").startswith(
        "| tiny | recommended: K = 1, in flight 2, buffer 4 | 1.100 | 1.000 (2 steps)"
    )
    assert "0:25% 1:75% | 1:100% |" in c.row("tiny")
