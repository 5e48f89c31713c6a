"""The rl launcher's supervision with real child processes (plain python commands, no model)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from prime_async.launcher.process import ChildProcess, tail_lines
from prime_async.launcher.progress import JsonlFollower
from prime_async.launcher.rl import _first_failure


def _component(tmp_path: Path, name: str, code: str) -> ChildProcess:
    return ChildProcess(name=name, command=[sys.executable, "-c", code], log_path=tmp_path / f"{name}.log")


def test_failure_of_one_component_is_detected_with_its_log(tmp_path: Path) -> None:
    ok = _component(tmp_path, "inference", "import time; time.sleep(60)")
    bad = _component(tmp_path, "trainer", "print('loading'); print('boom: bad batch'); raise SystemExit(3)")
    orch = _component(tmp_path, "orchestrator", "import time; time.sleep(60)")
    components = {"inference": ok, "trainer": bad, "orchestrator": orch}
    for c in components.values():
        c.start()
    deadline = time.monotonic() + 20
    failed = None
    while failed is None and time.monotonic() < deadline:
        failed = _first_failure(components)
        time.sleep(0.05)
    assert failed is bad and bad.returncode() == 3
    assert tail_lines(bad.log_path, 1) == ["boom: bad batch"]
    for c in components.values():
        c.stop(timeout_s=5)
    assert ok.returncode() is not None and orch.returncode() is not None


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print(p.pid, flush=True); time.sleep(60)"
    )
    parent = _component(tmp_path, "trainer", code)
    parent.start()
    deadline = time.monotonic() + 20
    while not tail_lines(parent.log_path, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(tail_lines(parent.log_path, 1)[0])
    parent.stop(timeout_s=5)
    # SIGTERM reached the whole group at once; the grandchild needs a moment to act on it.
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid), "the grandchild survived stop()"


def _alive(pid: int) -> bool:
    """True when the process exists and is not a zombie (nobody may reap orphans in a container)."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return False
    state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]


def test_jsonl_follower_returns_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    follower = JsonlFollower(path)
    assert follower.new_records() == []
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1')
    assert follower.new_records() == [{"step": 0}]
    with path.open("a") as f:
        f.write("}\n")
    assert follower.new_records() == [{"step": 1}]
    assert follower.new_records() == []


def test_progress_line_waits_for_the_trainer_record(tmp_path: Path, caplog) -> None:
    import logging

    from prime_async.launcher.progress import ProgressView

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    view = ProgressView(metrics_dir=metrics, max_steps=2)
    orch = {"step": 0, "reward/mean": 0.5, "rollout/tokens_per_s": 61.0}
    (metrics / "orchestrator.jsonl").write_text(json.dumps(orch) + "\n")
    with caplog.at_level(logging.INFO):
        view.poll()
        assert "step" not in caplog.text
        train = {"step": 0, "loss/total": 0.25, "perf/tokens_per_s": 900.0}
        (metrics / "trainer.jsonl").write_text(json.dumps(train) + "\n")
        view.poll()
    assert "reward 0.500" in caplog.text and "loss 0.250" in caplog.text
    assert "rollout 61 tok/s" in caplog.text and "train 900 tok/s" in caplog.text


def test_progress_line_shows_overflow_when_it_happens(tmp_path: Path, caplog) -> None:
    import logging

    from prime_async.launcher.progress import ProgressView

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    view = ProgressView(metrics_dir=metrics, max_steps=3)
    counts = [{}, {"env/guess/overflow_episodes": 3.0}, {"env/guess/overflow_episodes": 3.0}]
    orch = [
        {"step": s, "env/overflow_episodes": 0.0, "env/echo/overflow_episodes": 0.0, **c}
        for s, c in enumerate(counts)
    ]
    (metrics / "orchestrator.jsonl").write_text("".join(json.dumps(r) + "\n" for r in orch))
    (metrics / "trainer.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    with caplog.at_level(logging.INFO):
        view.poll()
    lines = [r.message for r in caplog.records if r.message.startswith("step")]
    assert "overflow" not in lines[0]  # nothing while there is none
    assert lines[1].endswith("| overflow guess +3 (3 in all)") and lines[2].endswith("| overflow guess 3")


def test_ensure_model_builds_what_the_config_names_not_what_the_directory_is_called(tmp_path: Path) -> None:
    import pytest

    from prime_async.config.loader import load_config
    from prime_async.config.rl import RLConfig
    from prime_async.launcher.rl import ensure_model

    named_tiny = tmp_path / "tiny"  # a name that used to trigger a build on its own
    cfg = load_config(RLConfig, ["--model.path", str(named_tiny), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"model\.build"):
        ensure_model(cfg)
    assert not named_tiny.exists()
    target = tmp_path / "my-model"
    cfg = load_config(
        RLConfig,
        ["--model.path", str(target), "--model.build", "tiny", "--output-dir", str(tmp_path / "out")],
    )
    ensure_model(cfg)
    assert (target / "config.json").exists()
