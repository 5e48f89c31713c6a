"""`rl-engines` (`launcher/engines_command.py`, `entrypoints/rl_engines.py`) against a thread that answers
the request files as the orchestrator's engine pool does: exit codes, the one printed line, no answer
within the deadline, and `remove` stopping (only) the engine `start` started."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_async.entrypoints.rl_engines import main
from prime_async.launcher import engines_command
from prime_async.orchestrator import engine_requests as requests
from prime_async.orchestrator.engine_requests import EngineRequest, EngineResult


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "configs").mkdir()
    requests.write_live(tmp_path, ["http://e0"], 3)  # what the orchestrator's pool writes at its start
    return tmp_path


@pytest.fixture
def orchestrator(run_dir: Path) -> Iterator[list[EngineRequest]]:
    """Answers every request: adds are joined, a remove of an unknown URL is refused."""
    seen: list[EngineRequest] = []
    engines = ["http://e0"]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for rid, req in requests.pending(run_dir):
                assert isinstance(req, EngineRequest)
                seen.append(req)
                if req.op == "add":
                    engines.append(req.url)
                    result = EngineResult(True, f"{req.url} joined at weight version 3", tuple(engines))
                elif req.url in engines:
                    engines.remove(req.url)
                    result = EngineResult(True, f"{req.url} left", tuple(engines))
                else:
                    result = EngineResult(False, f"remove {req.url} refused: not one of the run's engines")
                requests.answer(run_dir, rid, result)
            time.sleep(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield seen
    stop.set()
    thread.join(timeout=5)


def _exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


def test_add_and_remove_exit_codes_and_lines(run_dir: Path, orchestrator, capsys):
    assert _exit(["add", "--run", str(run_dir), "--url", "http://e1/", "--timeout-s", "5"]) == 0
    assert "http://e1 joined at weight version 3" in capsys.readouterr().out
    assert orchestrator == [EngineRequest("add", "http://e1", None, 5.0)]
    assert _exit(["remove", "--run", str(run_dir), "--url", "http://nope"]) == 1
    assert "refused" in capsys.readouterr().out
    assert _exit(["remove", "--run", str(run_dir), "--url", "http://e1"]) == 0


def test_bad_arguments_are_one_line_and_exit_2(run_dir: Path, tmp_path: Path, capsys):
    assert _exit(["add", "--run", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip() == "rl-engines: rl-engines add needs --url"
    assert _exit(["add", "--run", str(run_dir), "--url", "ftp://x"]) == 2
    assert _exit(["add", "--run", str(tmp_path / "nowhere"), "--url", "http://x"]) == 2
    assert "no orchestrator is running there" in capsys.readouterr().err


def test_no_orchestrator_answers_within_the_deadline(run_dir: Path, monkeypatch):
    monkeypatch.setattr(engines_command, "ANSWER_MARGIN_S", 0.2)
    result = engines_command.change(run_dir, EngineRequest("add", "http://e1", timeout_s=0.1))
    assert not result.ok and "no orchestrator answered" in result.message
    assert requests.pending(run_dir) == []  # the unanswered request is taken back


def test_remove_stops_only_the_engine_start_started(run_dir: Path, orchestrator):
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        url = "http://127.0.0.1:4242"
        record = requests.engines_dir(run_dir) / "started" / "4242.json"
        requests.write_json(record, {"pid": engine.pid, "url": url})
        assert engines_command.change(run_dir, EngineRequest("add", url, timeout_s=5)).ok
        assert engine.poll() is None  # joined: still serving
        assert engines_command.change(run_dir, EngineRequest("remove", url, timeout_s=5)).ok
        assert engine.wait(timeout=10) != 0 and not record.exists()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_list_reads_live_json(tmp_path: Path, capsys):
    run_dir = tmp_path
    main(["list", "--run", str(run_dir)])
    assert "no orchestrator is running" in capsys.readouterr().out
    requests.write_live(run_dir, ["http://e0", "http://e1"], 7)
    main(["list", "--run", str(run_dir)])
    assert capsys.readouterr().out.strip() == "2 engine(s) at weight version 7: http://e0, http://e1"
    assert json.loads((requests.engines_dir(run_dir) / "live.json").read_text())["served_version"] == 7


def test_start_records_the_engine_it_started_and_remove_stops_it(run_dir: Path, orchestrator, capsys):
    (run_dir / "configs" / "inference.toml").write_text("not_a_key = 1\n")  # the engine exits at once
    assert _exit(["start", "--run", str(run_dir), "--port", "4343", "--timeout-s", "5"]) == 0
    out = capsys.readouterr().out
    assert "http://127.0.0.1:4343 joined" in out and "pid " in out and "inference-4343.log" in out
    record = json.loads((requests.engines_dir(run_dir) / "started" / "4343.json").read_text())
    assert record["url"] == "http://127.0.0.1:4343" and record["pid"] > 0
    assert _exit(["remove", "--run", str(run_dir), "--url", "http://127.0.0.1:4343"]) == 0
    assert not (requests.engines_dir(run_dir) / "started" / "4343.json").exists()
