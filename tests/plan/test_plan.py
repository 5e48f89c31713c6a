"""The planner on a run directory written here (known timings): the profile it reads, the candidates it
simulates with the real scheduler (virtual clock), the report and the `plan --from-run` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import zygote
from prime_async.config.loader import dump_toml
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.plan.candidates import Candidate, candidate_grid, current_candidate, predict
from prime_async.plan.profile import WARMUP_STEPS, read_profile
from prime_async.plan.run import plan_run

STEPS = 10
TRAIN_S, PUBLISH_S, SYNC_S, CUT_S, STEP_S = 1.0, 0.05, 0.1, 0.01, 1.6
LATENCIES = (0.4, 0.6, 0.8, 1.2)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A K = 1 run of STEPS steps: every step 1.6 s, training 1.05 s, four episodes per step."""
    run = tmp_path / "run"
    (run / "configs").mkdir(parents=True)
    (run / "metrics").mkdir()
    cfg = OrchestratorConfig.model_validate({
        "output_dir": str(run), "batch_groups": 2, "group_size": 2, "max_off_policy_steps": 1,
        "admission": {"max_buffered_groups": 4}, "inference": {"base_urls": ["http://127.0.0.1:30000"],
                                                 "max_running_requests": 8},
    })  # fmt: skip
    (run / "configs" / "orchestrator.toml").write_text(dump_toml(cfg))
    t0 = 1000.0
    orch, trainer, episodes = [], [], []
    for step in range(STEPS):
        end = t0 + STEP_S * (step + 1)
        orch.append({"step": step, "time": end, "time/step": STEP_S, "time/sync_weights": SYNC_S,
                     "time/cut": CUT_S})  # fmt: skip
        trainer.append({"step": step, "time": end + TRAIN_S, "time/train": TRAIN_S,
                        "time/publish_weights": PUBLISH_S})  # fmt: skip
        for i, seconds in enumerate(LATENCIES):
            group = 2 * step + i // 2  # groups of 2: (0.4, 0.6) and (0.8, 1.2)
            episodes.append({"time": end - 0.1 * i, "status": "ok", "seconds": seconds, "group": group})
    _write_jsonl(run / "metrics" / "orchestrator.jsonl", orch)
    _write_jsonl(run / "metrics" / "trainer.jsonl", trainer)
    _write_jsonl(run / "metrics" / "episodes.jsonl", episodes)
    return run


def test_profile_reads_the_steady_state(run_dir: Path) -> None:
    profile = read_profile(run_dir)
    assert profile.train_time_s == pytest.approx(TRAIN_S + PUBLISH_S)
    assert profile.update_time_s == pytest.approx(SYNC_S) and profile.cut_time_s == pytest.approx(CUT_S)
    assert profile.step_time_s == pytest.approx(STEP_S) and profile.engines == 1
    assert set(profile.latency_samples) == set(LATENCIES)
    assert set(profile.latency_groups) == {LATENCIES[:2], LATENCIES[2:]}
    # warm-up steps' episodes are left out; what is left is the steady state
    assert len(profile.latency_samples) < STEPS * len(LATENCIES)
    assert profile.concurrency_per_engine >= 1


def test_profile_of_a_run_too_short_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    _write_jsonl(tmp_path / "metrics" / "orchestrator.jsonl", [{"step": 0, "time/step": 1.0}])
    with pytest.raises(ValueError, match=f"no orchestrator/trainer steps after the first {WARMUP_STEPS}"):
        read_profile(tmp_path)


def test_candidates_cover_k_buffers_and_engines(run_dir: Path) -> None:
    cfg = OrchestratorConfig.model_validate({"output_dir": str(run_dir), "max_off_policy_steps": 1})
    grid = candidate_grid(cfg)
    assert grid[0] == current_candidate(cfg) and grid[0].current
    assert {c.k for c in grid} >= {0, 1, 2, 4} and {c.engines for c in grid} == {1, 2}
    for c in grid:
        assert c.max_inflight_groups <= c.max_buffered_groups
        assert c.max_buffered_groups >= cfg.batch_groups
    assert len({(c.k, c.max_inflight_groups, c.max_buffered_groups, c.engines) for c in grid}) == len(grid)


def test_predictions_respect_k_and_async_overlaps(run_dir: Path) -> None:
    from prime_async.plan.run import run_config

    cfg, profile = run_config(run_dir), read_profile(run_dir)
    sync = predict(cfg, profile, Candidate(k=0, max_inflight_groups=2, max_buffered_groups=2, engines=1))
    async1 = predict(cfg, profile, Candidate(k=1, max_inflight_groups=4, max_buffered_groups=4, engines=1))
    assert set(sync.staleness) == {0} and max(async1.staleness) <= 1
    assert sum(async1.staleness.values()) == pytest.approx(1.0)
    # sync waits for generation and training one after the other; async overlaps them
    assert sync.step_time_s > async1.step_time_s
    # a sync step is at least training plus the slowest group's slowest episode (0.6 s or 1.2 s)
    assert sync.step_time_s >= TRAIN_S + PUBLISH_S + LATENCIES[1]


def test_plan_from_run_prints_the_table_and_a_recommendation(run_dir: Path) -> None:
    report = plan_run(run_dir)
    assert "recommended: K = " in report and "flags: --orchestrator.max_off_policy_steps" in report
    assert "* = the config as given" in report and "engines-to-trainer:" in report
    proc = zygote.run([sys.executable, "-m", "prime_async.entrypoints.plan", "--from-run", str(run_dir)],
                      timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "recommended: K = " in proc.stdout


def test_plan_from_a_directory_without_a_run_is_one_line(tmp_path: Path) -> None:
    proc = zygote.run([sys.executable, "-m", "prime_async.entrypoints.plan", "--from-run", str(tmp_path)],
                      timeout=120)  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.startswith("plan: error: ")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_profile_reads_what_images_cost(run_dir: Path) -> None:
    """A VLM run: the tower's seconds per step and the images per episode read apart (their time is
    already inside the latencies the simulation draws); a text run shows neither."""
    assert (
        read_profile(run_dir).vision_time_s == 0.0 and "vision tower" not in read_profile(run_dir).describe()
    )
    path = run_dir / "metrics" / "orchestrator.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.update({"inference/vision_s": 0.016, "rollout/images_per_episode": 2.0})
    _write_jsonl(path, rows)
    profile = read_profile(run_dir)
    assert profile.vision_time_s == pytest.approx(0.016) and profile.images_per_episode == 2.0
    per_step = profile.episodes_per_step  # steady-state episodes per steady-state step
    assert profile.vision_s_per_image == pytest.approx(0.016 / (2.0 * per_step))
    assert "images 2.0 per episode: vision tower 0.016s/step" in profile.describe()
