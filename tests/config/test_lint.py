"""The configuration lint (`config/lint.py`): each rule fires on its combination with its line, every shipped
config under configs/ is quiet, `doctor`'s report lists the warnings, and `rl --dry-run` prints them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prime_async.config import lint
from prime_async.config.loader import load_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.rl import RLConfig
from prime_async.config.trainer import TrainerConfig
from prime_async.doctor.checks import CheckResult
from prime_async.doctor.report import render

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs").rglob("*.toml"))
SCHEMAS = {"rl": RLConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}


def _rl(interval: int = 1, **orchestrator: object) -> RLConfig:
    return RLConfig.model_validate({"weights": {"update_interval": interval}, "orchestrator": orchestrator})


def _lines(cfg: RLConfig) -> list[str]:
    return [finding.line() for finding in lint.lint_rl(cfg)]


def test_defaults_are_quiet() -> None:
    assert _lines(RLConfig()) == []


def test_multi_step_offpolicy() -> None:
    cfg = RLConfig.model_validate(
        {"orchestrator": {"max_off_policy_steps": 2}, "trainer": {"optim": {"num_steps_per_batch": 4}}}
    )
    assert _lines(cfg) == [
        "lint/multi-step-offpolicy: optim.num_steps_per_batch = 4 at max_off_policy_steps = 2 trains "
        "tokens up to 11 optimizer steps off-policy instead of 2 (each extra step per batch adds drift on "
        "top of K); "
        "fix: set optim.num_steps_per_batch = 1 (a larger batch instead), or lower max_off_policy_steps"
    ]
    on_policy = RLConfig.model_validate(
        {"orchestrator": {"max_off_policy_steps": 0}, "trainer": {"optim": {"num_steps_per_batch": 4}}}
    )
    assert _lines(on_policy) == []  # K = 0: several steps per batch is PPO-style reuse, no drift from K
    assert lint.lint_trainer(TrainerConfig.model_validate({"optim": {"num_steps_per_batch": 4}})) == []


def test_buffer_deeper_than_k() -> None:
    [finding] = lint.lint_rl(
        _rl(max_off_policy_steps=1, batch_groups=4, admission={"max_buffered_groups": 12})
    )
    assert finding.id == "lint/buffer-deeper-than-k"
    assert (
        "admission.max_buffered_groups = 12 > (max_off_policy_steps + 1) * batch_groups = 8" in finding.cost
    )
    assert "so 4 slots never fill" in finding.cost and "default 8" in finding.fix
    assert lint.lint_orchestrator(
        OrchestratorConfig.model_validate({"admission": {"max_buffered_groups": 73}})
    )
    assert _lines(_rl(max_off_policy_steps=1, batch_groups=4, admission={"max_buffered_groups": 8})) == []


def test_update_interval_lag() -> None:
    [line] = _lines(_rl(2, max_off_policy_steps=2))
    assert line.startswith(
        "lint/update-interval-lag: weights.update_interval = 2 with max_off_policy_steps = 2"
    )
    assert "lag the trainer by up to 1 version(s)" in line and "fix: set weights.update_interval = 1" in line
    assert _lines(_rl(2, max_off_policy_steps=8)) == []  # 1 of 8: small


def test_max_tokens_near_seq_len_names_the_env_and_the_margin() -> None:
    cfg = RLConfig.model_validate({"seq_len": 256, "orchestrator": {"sampling": {"max_tokens": 240}}})
    [line] = _lines(cfg)
    assert line.startswith(
        "lint/max-tokens-near-seq-len: orchestrator.sampling.max_tokens = 240 with seq_len = 256 leaves 16 "
        "tokens for the prompt"
    )
    assert "batch.sink.overlong = 'truncate'" in line and "lower max_tokens (<= 192" in line
    override = {"seq_len": 256, "orchestrator": {"envs": [{"sampling": {"max_tokens": 200}}]}}
    [line] = _lines(RLConfig.model_validate(override))
    assert "orchestrator.envs[reverse-text].sampling.max_tokens = 200" in line
    assert (
        _lines(RLConfig.model_validate({"seq_len": 256, "orchestrator": {"sampling": {"max_tokens": 192}}}))
        == []
    )


def test_group_size_one() -> None:
    [line] = _lines(_rl(group_size=1))
    assert line == (
        "lint/group-size-one: group_size = 1: the group-relative advantage (reward - group mean) is always "
        "0: no learning signal; fix: set group_size >= 2 (4-16 is usual)"
    )
    [line] = _lines(_rl(group_size=1, batch={"sink": {"reject_equal_reward": True}}))
    assert "batch.sink.reject_equal_reward drops every group" in line


def test_drain_offpolicy() -> None:
    cfg = RLConfig.model_validate(
        {"weights": {"pause_mode": "drain"}, "orchestrator": {"max_off_policy_steps": 2}}
    )
    [line] = _lines(cfg)
    assert line.startswith('lint/drain-offpolicy: weights.pause_mode = "drain" with max_off_policy_steps = 2')
    assert 'fix: set weights.pause_mode = "retract"' in line
    assert (
        _lines(cfg.with_values(orchestrator={"max_off_policy_steps": 0})) == []
    )  # configs/tiny/rl_sync.toml


def _schema(path: Path) -> type[RLConfig | OrchestratorConfig | TrainerConfig] | None:
    return next((cls for prefix, cls in SCHEMAS.items() if path.stem.startswith(prefix)), None)


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_config_is_quiet(path: Path) -> None:
    cls = _schema(path)
    if cls is None:
        pytest.skip("not an rl, orchestrator or trainer config")
    cfg = load_config(cls, ["@", str(path)])
    rules = {
        RLConfig: lint.lint_rl,
        OrchestratorConfig: lint.lint_orchestrator,
        TrainerConfig: lint.lint_trainer,
    }
    assert [f.line() for f in rules[cls](cfg)] == []


def test_doctor_report_lists_the_warnings_without_failing() -> None:
    rows = [("env-a", CheckResult("prompt fits seq_len", True, "ok"))]
    text = render(rows, [line for line in _lines(_rl(group_size=1))])
    assert "warning lint/group-size-one: group_size = 1" in text and "config lint: 1 warning(s)" in text
    assert text.endswith("doctor: every check passed (or was skipped, see detail)")
    assert "config lint: no warning" in render(rows)


def test_rl_dry_run_prints_the_warnings_after_the_toml(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text(
        "seq_len = 256\n[weights]\nupdate_interval = 2\n"
        "[orchestrator]\ngroup_size = 1\nmax_off_policy_steps = 2\n"
        "[orchestrator.admission]\nmax_buffered_groups = 64\n[orchestrator.sampling]\nmax_tokens = 240\n"
        "[trainer.optim]\nnum_steps_per_batch = 4\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    rl = str(Path(sys.executable).parent / "rl")
    result = subprocess.run(
        [rl, "@", "bad.toml", "--dry-run"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["orchestrator"]["group_size"] == 1  # stdout stays the TOML
    warnings = [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("WARNING ")]
    assert warnings == [
        "WARNING lint/buffer-deeper-than-k",
        "WARNING lint/update-interval-lag",
        "WARNING lint/max-tokens-near-seq-len",
        "WARNING lint/group-size-one",
        "WARNING lint/multi-step-offpolicy",
    ]


def test_rl_logs_the_warnings_at_start_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from prime_async.entrypoints import commands

    started: list[object] = []
    monkeypatch.setattr(commands, "setup_logging", lambda log, component: None)  # keep pytest's handlers
    monkeypatch.setattr(commands, "run_component", lambda run, cfg, component: started.append(cfg))
    (tmp_path / "bad.toml").write_text("[orchestrator]\ngroup_size = 1\n")
    with caplog.at_level(logging.WARNING, logger="prime_async.entrypoints.commands"):
        commands.COMMANDS["rl"](["@", str(tmp_path / "bad.toml")])
    assert len(started) == 1  # the run starts anyway
    assert [r.message.split(":")[0] for r in caplog.records] == ["lint/group-size-one"]
