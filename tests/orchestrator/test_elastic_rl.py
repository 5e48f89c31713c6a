"""The elastic engine pool in a real tiny `rl` run on CPU (`docs/elastic.md`): a second engine joins once
step 4 is done (`rl-engines add`), the engine `rl` started leaves once step 8 is done (`rl-engines remove`),
and an engine that dies while joining is refused with one line while the run goes on.

Checked from the orchestrator's metrics: every step produced and trained once, the ledger balances at
every step, staleness in [0, K], and `inference/engines` per step goes 1 -> 2 -> 1 at those steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import zygote
from proc_helpers import free_port, read_jsonl, start_embedded_engine

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = ("inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}
STEPS, K, RUN_ID = 24, 1, "elastic-test"


def _wait(what: str, ready: Callable[[], bool], rl: zygote.Process, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert rl.poll() is None, f"rl exited {rl.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.2)


def _steps_done(out: Path) -> int:
    return len(read_jsonl(out / "metrics" / "orchestrator.jsonl"))


def _engine(work: Path, model_dir: Path) -> tuple[str, zygote.Process]:
    """An embedded engine of the run (its run id and model), healthy, started before `rl`."""
    work.mkdir(parents=True)
    config = f"""backend = "torch"\noutput_dir = "{work}"\nseq_len = 256\nrun_id = "{RUN_ID}"
[model]\npath = "{model_dir}"\n[engine]\nmax_running_requests = 8\n"""
    return start_embedded_engine(config, work, timeout_s=300)


def _engines_cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "prime_async.entrypoints.rl_engines", *args, "--run", str(out)]


def _change(out: Path, *args: str) -> subprocess.CompletedProcess:
    return zygote.run(_engines_cmd(out, *args), cwd=ROOT, env=ENV, timeout=200)  # fmt: skip


def _first_url(out: Path) -> str:
    import tomllib

    return tomllib.loads((out / "configs" / "orchestrator.toml").read_text())["inference"]["base_urls"][0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_engine_joins_at_step_4_and_leaves_at_step_8_one_dies_joining(
    tiny_model_dir: Path, tmp_path: Path
):
    out = tmp_path / "run"
    started: list[zygote.Process] = []
    try:
        (joiner, proc), (dying, dying_proc) = (_engine(tmp_path / n, tiny_model_dir) for n in ("j", "d"))
        started += [proc, dying_proc]
        rl = _start_rl(out, tiny_model_dir)
        started.insert(0, rl)
        _wait("step 4", lambda: _steps_done(out) >= 4, rl)  # steps 0-3 done
        added = _change(out, "add", "--url", joiner, "--timeout-s", "120")
        assert added.returncode == 0 and "joined at weight version" in added.stdout, (
            added.stdout + added.stderr
        )
        joined_at = int(added.stdout.split("joined at weight version", 1)[1].split()[0])
        _wait("step 8", lambda: _steps_done(out) >= 8, rl)
        removed = _change(out, "remove", "--url", _first_url(out), "--timeout-s", "120")
        assert removed.returncode == 0, removed.stdout + removed.stderr
        # dies while joining: killed as its join request is handed over (its health check then fails)
        ask = _engines_cmd(out, "add", "--url", dying, "--timeout-s", "2")
        asking = subprocess.Popen(
            ask, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        dying_proc.kill()
        refused = asking.communicate(timeout=120)[0]
        assert asking.returncode == 1 and "refused" in refused, refused
        assert rl.wait(timeout=600) == 0, (tmp_path / "rl.log").read_text()[-3000:]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    _check_run(out, dying)
    # the joiner was loaded with the served version at its join before it was routed to, then every later one
    loads = [
        line for line in (tmp_path / "j" / "engine.log").read_text().splitlines() if "tensors from" in line
    ]
    first = int(loads[0].rsplit("as version ", 1)[1])
    # steps 0-3 done at the add: the served version is at least 3 - K (step 3's batch needed it)
    assert first == joined_at >= 3 - K and f"broadcasts/step_{first} " in loads[0], (joined_at, loads[:2])


def _start_rl(out: Path, model_dir: Path) -> zygote.Process:
    cmd = [
        sys.executable, "-m", "prime_async.entrypoints.rl", "@", str(ROOT / "configs/tiny/rl.toml"),
        "--output-dir", str(out), "--model.path", str(model_dir), "--max-steps", str(STEPS),
        "--run-id", RUN_ID, "--inference.server.port", str(free_port()), "--transport.port", str(free_port()),
        "--orchestrator.max-off-policy-steps", str(K), "--orchestrator.sampling.max-tokens", "128",
    ]  # fmt: skip
    with (out.parent / "rl.log").open("w") as log:
        return zygote.popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def _check_run(out: Path, dying: str) -> None:
    orch = read_jsonl(out / "metrics" / "orchestrator.jsonl")
    trainer = read_jsonl(out / "metrics" / "trainer.jsonl")
    assert [m["step"] for m in orch] == list(range(STEPS)) and [m["step"] for m in trainer] == list(
        range(STEPS)
    )
    for m in orch:
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in BUCKETS), m
        assert m["rollout/data_staleness/min"] >= 0 and m["rollout/token_staleness/max"] <= K, m
    counts = [int(m["inference/engines"]) for m in orch]
    print("inference/engines per step:", counts)
    two = [i for i, n in enumerate(counts) if n == 2]
    assert counts[0] == 1 and two and two[0] >= 4 and counts[-1] == 1, counts
    assert counts.index(1, two[0]) >= 8 and set(counts) == {1, 2}, counts
    assert not (out / "engines" / "live.json").exists(), "the pool says no orchestrator runs any more"
    log = (out / "logs" / "orchestrator.log").read_text()
    assert log.count(f"add {dying} refused") == 1, "the engine that died while joining: one line"
