"""The five console scripts, run as real subprocesses: `--help`, `--dry-run` and one-line errors.

They only parse configs here (no component starts), so each call takes about as long as importing pydantic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
COMMANDS = ["inference", "orchestrator", "trainer", "rl", "eval"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_help_exits_0_and_lists_fields(command: str) -> None:
    result = run(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"usage: {command}" in result.stdout
    assert "--output-dir" in result.stdout and "model.path" in result.stdout and "(default: " in result.stdout
    if command in ("orchestrator", "rl"):
        assert "max-off-policy-steps" in result.stdout


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from prime_async.entrypoints.rl import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'rl --help imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dry_run_prints_resolved_toml(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text("seq_len = 333\n[optim]\nlr = 2e-6\n")
    result = run("trainer", "@", "t.toml", "--optim.lr", "4e-6", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = tomllib.loads(result.stdout)
    assert resolved["seq_len"] == 333 and resolved["optim"]["lr"] == 4e-6


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["orchestrator", "--max-off-policy-steps", "-1"],
            "orchestrator: error: --max-off-policy-steps: Input should be greater than or equal to 0 "
            "(got '-1')",
        ),
        (["rl", "@", "missing.toml"], "rl: error: config file not found: missing.toml"),
        (
            ["eval", "--weights.steps", "[3]"],
            "eval: error: --weights.steps: weights: weights.steps, weights.include_base: set "
            "weights.run_dir (a run's output_dir)",
        ),
        (
            ["inference", "--server.prot", "1"],
            "inference: error: --server.prot: unknown key 'server.prot' (did you mean 'server.port'?)",
        ),
        (
            ["rl", "--seq-len", "512", "--trainer.seq-len", "256"],
            "rl: error: trainer.seq_len = 256 conflicts with seq_len = 512: rl copies seq_len into "
            "trainer.seq_len, so set only seq_len",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    result = run(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == expected + "\n"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    ci_lines = [line for line in (repo / ".ci" / "run").read_text().splitlines() if "uv run" in line]
    assert len(ci_lines) == 1
    assert ci_lines[0].strip() in readme
    assert ci_lines[0].strip().endswith("uv run --extra megatron --extra sglang pytest")
