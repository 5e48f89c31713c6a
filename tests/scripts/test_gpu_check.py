"""scripts/gpu_check.sh's machinery on the CPU: the check list (--dry-run), the table, a failing, a hanging
and a process-leaking check that do not stop the others, the install from a wheelhouse, the real
versions check, and bad arguments. The GPU checks themselves run only where a GPU is (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import make_wheel

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": ""}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _rows(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("check", "---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_dry_run_lists_every_check_with_its_command() -> None:
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(" | ")[0]: line for line in proc.stdout.splitlines()[1:]}
    assert list(lines) == [
        "install", "models", "versions", "rl_filesystem", "rl_shared", "rl_distributed", "shared_weights",
        "static_decode", "conformance", "conformance_sglang", "moe_replay", "router_replay_tests",
        "megatron_gpu", "megatron_rl_ckpt", "megatron_tests", "bench_engine", "bench_engine_bf16",
        "bench_trainer",
    ]  # fmt: skip
    assert "--weights.transport shared" in lines["rl_shared"]
    assert (
        "| gpus2 |" in lines["rl_distributed"]
        and "--weights.transport distributed" in lines["rl_distributed"]
    )
    assert "test_conformance.py -m 'gpu or not gpu' -k embedded" in lines["conformance"]
    assert "| sglang |" in lines["conformance_sglang"]
    assert "--router-replay true" in lines["moe_replay"] and "moe/routing_agreement" in lines["moe_replay"]
    assert "| gpu |" in lines["megatron_gpu"] and "--trainer.backend megatron" in lines["megatron_rl_ckpt"]
    assert "--device cuda" in lines["bench_engine"] and "--device cuda" in lines["bench_trainer"]
    assert "--decode-steps eager auto --dtype bfloat16" in lines["bench_engine_bf16"]
    assert "test_static_decode.py" in lines["static_decode"] and "-k shared" in lines["shared_weights"]
    cpu = _run("--dry-run", "--cpu", "--timeout", "conformance=7")
    assert "--device cpu" in cpu.stdout and "conformance | b | 7 |" in cpu.stdout


def test_a_failing_check_does_not_stop_the_others(tmp_path: Path) -> None:
    """The real versions check, then one that fails, one that leaves a detached child behind, one that hangs
    past its limit and one that passes: each gets its row, FAIL rows name their log, the leaked child is
    killed, exit status is the number of FAIL rows."""
    leak = tmp_path / "leak.sh"
    leak.write_text(f"setsid sleep 300 &\necho $! > {tmp_path / 'leaked.pid'}\nexit 3\n")
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run(
        "--cpu", "--python", sys.executable, "--out", str(out), "--only", "versions,bad,leak,hang,ok",
        "--extra", "bad=echo boom >&2; false", "--extra", f"leak=bash {leak}", "--extra", "hang=sleep 100",
        "--extra", "ok=echo fine", "--timeout", "hang=5",
    )  # fmt: skip
    assert time.monotonic() - start < 200  # the versions check may take up to its 90 s limit under load
    assert proc.returncode == 3, proc.stdout + proc.stderr
    rows = _rows((out / "table.md").read_text())
    assert list(rows) == ["versions", "bad", "leak", "hang", "ok"]
    assert (
        rows["versions"][0] == "pass"
        and "torch" in rows["versions"][2]
        and "no CUDA device" in rows["versions"][2]
    )
    assert (
        rows["bad"] == [rows["bad"][0], rows["bad"][1], "rc 1: boom; logs/bad.log"]
        and rows["bad"][0] == "FAIL"
    )
    assert rows["leak"][0] == "FAIL" and "killed 1 leftover process(es)" in rows["leak"][2]
    assert rows["hang"][0] == "FAIL" and rows["hang"][2] == "timed out after 5s; logs/hang.log"
    assert int(rows["hang"][1]) < 20
    assert rows["ok"] == ["pass", rows["ok"][1], "fine"]
    leaked = int((tmp_path / "leaked.pid").read_text())
    assert not Path(f"/proc/{leaked}").exists() or "zombie" in Path(f"/proc/{leaked}/status").read_text()
    assert (out / "logs" / "bad.log").read_text().startswith("$ echo boom")


def test_install_from_a_wheelhouse(tmp_path: Path, pip_python: Path) -> None:
    """`--wheels DIR`: the wheels go to a fresh --target with pip, no index; the checks import them."""
    make_wheel(tmp_path / "wheels" / "whl", "gpucheck_probe", "1.0", body="X = 42\n")
    out = tmp_path / "out"
    probe = "probe=$PY -c 'import gpucheck_probe as p; print(\"probe\", p.X)'"
    proc = _run("--cpu", "--python", str(pip_python), "--wheels", str(tmp_path / "wheels"), "--out", str(out),
                "--only", "install,probe", "--extra", probe)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows((out / "table.md").read_text())
    assert rows["install"][0] == "pass" and rows["install"][2].startswith("1 wheels into ")
    assert rows["probe"] == ["pass", rows["probe"][1], "probe 42"]
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _run(
        "--cpu", "--python", str(pip_python), "--wheels", str(empty), "--out", str(out), "--only", "install"
    )
    assert proc.returncode == 1 and "no *.whl in" in _rows((out / "table.md").read_text())["install"][2]


def test_bad_arguments_are_named() -> None:
    for args, message in [
        (["--timeout", "conformance"], "--timeout wants NAME=SECONDS, got 'conformance'"),
        (["--wheels", "/nonexistent/wh"], "--wheels /nonexistent/wh: no such folder"),
        (["--frobnicate"], "unknown argument '--frobnicate'"),
    ]:
        proc = _run(*args, "--dry-run")
        assert proc.returncode == 100 and message in proc.stderr, (args, proc.stderr)
