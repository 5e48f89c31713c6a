"""Errors before anything starts: `rl` (and `--dry-run`) imports every environment and validates its args
before any process exists (`rollouts/env_check.py` through the loader's `check` hook).

An unknown env id exits 2 with "did you mean" over the installed environments; a typo in an arg names
the config class it belongs to (the taskset's, not the env's `SingleAgentEnvConfig`); an env that is
installed but fails to import says so; eval envs are checked with their own key.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import zygote
from prime_async.config.env import EnvConfig
from prime_async.config.loader import load_config, parse_config
from prime_async.config.rl import RLConfig
from prime_async.entrypoints.commands import check_run_envs
from prime_async.rollouts.env_check import env_keys, find_env, installed_env_ids
from prime_async.rollouts.verifiers_config import resolve_verifiers_config

ROOT = Path(__file__).resolve().parents[2]
RL = Path(sys.executable).parent / "rl"


def _rl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "prime_async.entrypoints.rl", *args], cwd=cwd, timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_typo_in_the_env_id_exits_2_with_a_suggestion_before_anything_starts(
    tmp_path: Path, dry_run: bool
) -> None:
    out = tmp_path / "run"
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--orchestrator.env.id", "reverse-txt"]
    args += ["--output-dir", str(out), *(["--dry-run"] if dry_run else [])]
    t0 = time.monotonic()
    result = _rl(*args, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == "", "nothing printed: the config was refused"
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        "rl: error: orchestrator.env.id 'reverse-txt': no installed environment has this id"
    )
    assert "did you mean 'reverse-text'?" in line and "calculator" in line
    assert not out.exists(), "no process started: nothing written"
    assert time.monotonic() - t0 < 120


def test_an_arg_typo_names_the_taskset_config_class(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "typo.toml").write_text("[orchestrator.env.args]\nnum_exampels = 3\n")
    argv = ["@", str(ROOT / "configs/tiny/rl.toml"), "@", str(tmp_path / "typo.toml"), "--dry-run"]
    with pytest.raises(SystemExit) as info:
        parse_config(RLConfig, argv, prog="rl", check=check_run_envs)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "rl: error: orchestrator.env.args.num_exampels: unknown key (did you mean 'num_examples'?): "
        "reverse_text.taskset.ReverseTextTasksetConfig declares task, system_prompt, id, num_examples, seed "
        "(environment 'reverse-text')"
    )
    seat = EnvConfig(id="reverse-text", config={"agent": {"max_turnz": 2}})
    with pytest.raises(ValueError, match=r"agent.max_turnz: unknown key \(did you mean 'max_turns'\?\): "
                       r"verifiers.v1.configs.agent.AgentConfig declares"):  # fmt: skip
        resolve_verifiers_config(seat)
    value = EnvConfig(id="reverse-text", args={"seed": "x"})
    with pytest.raises(ValueError, match=r"args.seed: Input should be a valid integer.*a field of "
                       r"reverse_text.taskset.ReverseTextTasksetConfig"):  # fmt: skip
        resolve_verifiers_config(value)


def test_a_valid_run_passes_and_eval_envs_are_checked_under_their_key(tmp_path: Path) -> None:
    cfg = load_config(RLConfig, ["@", str(ROOT / "configs/tiny/rl.toml")])
    check_run_envs(cfg)  # the tiny config's env imports and validates
    keys = [k for k, _ in env_keys(cfg.orchestrator)]
    assert keys == ["orchestrator.env"]
    with pytest.raises(
        ValueError, match=r"^orchestrator.eval.envs\[0\].id 'calculater': .*did you mean 'calculator'"
    ):
        find_env("calculater", "orchestrator.eval.envs[0].id")
    assert {"reverse-text", "calculator", "word-chain"} <= set(installed_env_ids())
    assert "prime-async" not in installed_env_ids()


def test_an_installed_env_that_fails_to_import_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "broken_env_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        resolve_verifiers_config(EnvConfig(id="broken-env-pkg"), key="orchestrator.envs[1]")
    assert str(info.value) == (
        "orchestrator.envs[1].id 'broken-env-pkg': the environment is installed but importing it failed: "
        "No module named 'a_dependency_that_is_not_installed'"
    )
