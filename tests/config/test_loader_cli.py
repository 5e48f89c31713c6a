"""The real console scripts as subprocesses: exit codes, one-line errors, --help, --dry-run."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


def command(name: str) -> list[str]:
    """The installed console script of this environment (falls back to `python -m`)."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", f"prime_async.entrypoints.{name}"]


def run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*command(name), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["orchestrator", "trainer", "inference"])
def test_help_exits_0_and_lists_fields(name, tmp_path):
    result = run(name, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {name} [@ FILE.toml ...]")
    assert "--model.path str" in result.stdout  # pydantic-settings' help: flag, type, default
    if name == "orchestrator":
        assert "--max-off-policy-steps int" in result.stdout and "(default: 8)" in result.stdout


def test_out_of_range_value_is_one_line_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text("max_off_policy_steps = -1\n")
    result = run("orchestrator", "@", "bad.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "orchestrator: error: bad.toml: max_off_policy_steps: Input should be greater than or equal to 0 "
        "(got -1)\n"
    )


def test_missing_file_and_unknown_flag_exit_2_without_traceback(tmp_path):
    result = run("trainer", "@", "nope.toml", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, "trainer: error: config file not found: nope.toml\n")
    result = run("orchestrator", "--max-off-policy-step", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "orchestrator: error: --max-off-policy-step: unknown key 'max-off-policy-step' "
        "(did you mean 'max_off_policy_steps'?)\n"
    )


def test_cross_field_error_from_the_real_schema(tmp_path):
    (tmp_path / "o.toml").write_text("batch_groups = 8\nadmission.max_buffered_groups = 4\n")
    result = run("orchestrator", "@", "o.toml", cwd=tmp_path)
    assert result.returncode == 2
    expected = "orchestrator: error: o.toml: admission.max_buffered_groups (4) < batch_groups (8)"
    assert result.stderr.startswith(expected)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_dry_run_prints_resolved_toml_and_exits_0(tmp_path):
    (tmp_path / "o.toml").write_text("max_off_policy_steps = 2\n[wandb]\nenabled = true\n")
    flags = ["--no-wandb.enabled", "--batch-groups", "3", "--dry-run"]
    result = run("orchestrator", "@", "o.toml", *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = tomllib.loads(result.stdout)
    assert resolved["max_off_policy_steps"] == 2 and resolved["batch_groups"] == 3
    assert resolved["wandb"]["enabled"] is False
