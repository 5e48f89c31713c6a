"""The distillation teacher's engine SIGKILLed mid-run in a real `rl` run (tiny model, the teacher is the
student's initial model, as in tests/orchestrator/test_opd_rl.py): `rl` restarts it with its own config,
the orchestrator holds scoring meanwhile (finished groups wait, requests retried with backoff), and the
run finishes with every step trained and no teacher error. The same protocol on the simulator with a
fake teacher: tests/orchestrator/test_teacher_failures.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from reliability_soak import Kill, SoakRun, read_jsonl, run_rl


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_teacher_engine_killed_mid_run_is_restarted_and_the_run_finishes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = SoakRun(
        out=tmp_path / "run", steps=8, k=1, pause_mode="retract", max_buffered_groups=2,
        kills=[Kill("teacher_inference", at_step=2)],
    )  # fmt: skip
    teacher = [
        "--orchestrator.teacher.model",
        str(tiny_model_dir),
        "--orchestrator.teacher.outage-timeout-s",
        "120",
    ]
    run_rl(run, model_dir=tiny_model_dir, timeout_s=300, extra=teacher, orchestrator_ckpt_interval=None)
    orch_log = (run.out / "logs/orchestrator.log").read_text()
    tails = f"{run.stderr[-3000:]}\n--- orchestrator\n{orch_log[-3000:]}"
    assert run.returncode == 0, tails
    assert run.kills[0].pid, "the teacher engine was never killed"
    assert len(re.findall(r"teacher_inference exited with status -9: restart 1/1", run.stderr)) == 1, tails
    assert "teacher unreachable" in orch_log and "teacher answers again after" in orch_log, tails
    rows = read_jsonl(run.out / "metrics/orchestrator.jsonl")
    assert [r["step"] for r in rows] == list(range(8)), rows
    assert sum(r["teacher/errors"] for r in rows) == 0 and rows[-1]["ledger/errored"] == 0, rows
    assert sum(r["teacher/retries"] for r in rows) >= 1 and sum(r["teacher/outage_s"] for r in rows) > 0, rows
