"""Every TOML under `configs/` parses into the config class its file name names.

`rl*.toml` -> RLConfig, `inference*.toml` -> InferenceConfig, `orchestrator*.toml` -> OrchestratorConfig,
`trainer*.toml` -> TrainerConfig, `eval*.toml` -> EvalConfig (the `eval` command), `sft*.toml` ->
SFTConfig. A file matching none of these fails the test, so a new config cannot slip in untested.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from prime_async.config.eval import EvalConfig
from prime_async.config.inference import InferenceConfig
from prime_async.config.loader import load_config
from prime_async.config.megatron import megatron_installed
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.rl import RLConfig
from prime_async.config.sft import SFTConfig
from prime_async.config.trainer import TrainerConfig

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
CLASSES = {
    "rl": RLConfig,
    "inference": InferenceConfig,
    "orchestrator": OrchestratorConfig,
    "trainer": TrainerConfig,
    "eval": EvalConfig,
    "sft": SFTConfig,
}
ALL_TOML = sorted(CONFIGS_DIR.rglob("*.toml"))


def config_class(path: Path) -> type:
    for prefix, cls in CLASSES.items():
        if path.name.startswith(prefix):
            return cls
    raise AssertionError(
        f"{path}: name must start with one of {sorted(CLASSES)} to say which command reads it"
    )


def test_configs_dir_has_the_demo() -> None:
    assert CONFIGS_DIR / "echo_text" / "rl.toml" in ALL_TOML  # the README's first command
    assert CONFIGS_DIR / "reverse_text" / "rl.toml" in ALL_TOML


def needs_missing_extra(path: Path) -> str | None:
    """Why `path` cannot validate here: a megatron trainer config checks for megatron-core at validation."""
    raw = tomllib.loads(path.read_text())
    backend = raw.get("backend") if path.name.startswith("trainer") else raw.get("trainer", {}).get("backend")
    if backend == "megatron" and not megatron_installed():
        return "needs the megatron extra (uv sync --extra megatron)"
    return None


@pytest.mark.parametrize("path", ALL_TOML, ids=[str(p.relative_to(CONFIGS_DIR)) for p in ALL_TOML])
def test_config_file_parses(path: Path) -> None:
    reason = needs_missing_extra(path)
    if reason is not None:
        pytest.skip(reason)
    cfg = load_config(config_class(path), ["@", str(path)])
    if isinstance(cfg, RLConfig):
        assert cfg.trainer.seq_len == cfg.orchestrator.seq_len == cfg.inference.seq_len == cfg.seq_len
        assert cfg.trainer.max_off_policy_steps == cfg.orchestrator.max_off_policy_steps


@pytest.mark.parametrize("demo", ["echo_text", "reverse_text"])
def test_sync_and_async_demo_runs_share_a_wandb_group(demo: str) -> None:
    runs = [
        load_config(RLConfig, ["@", str(CONFIGS_DIR / demo / name)]) for name in ("rl.toml", "rl_sync.toml")
    ]
    assert runs[0].wandb.group == runs[1].wandb.group is not None
    assert runs[0].wandb.name != runs[1].wandb.name
    assert (runs[0].orchestrator.max_off_policy_steps, runs[1].orchestrator.max_off_policy_steps) == (1, 0)
    assert runs[0].output_dir != runs[1].output_dir
