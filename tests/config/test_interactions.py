"""Feature interactions refused at start (`config/interactions.py`): one line naming both keys, and the
defaults `rl` derives where two features meet (LoRA adapter slots from K)."""

from __future__ import annotations

import pytest

from prime_async.config.interactions import lora_slots_needed
from prime_async.config.loader import ConfigError, load_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.rl import RLConfig

LORA = ["--lora.rank", "4"]


def rl_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(RLConfig, argv)
    message = str(info.value)
    assert "\n" not in message.strip(), "a refusal is one line"
    return message


def test_lora_adapter_slots_follow_k_by_default() -> None:
    """Regression: the default 4 slots with the default K = 8 filled up after a few updates and the
    engine refused the next adapter, which ended the run."""
    cfg = load_config(RLConfig, [*LORA, "--orchestrator.max-off-policy-steps", "8"])
    assert cfg.inference.max_loaded_loras == lora_slots_needed(8, 1) == 10
    cfg = load_config(RLConfig, [*LORA, "--orchestrator.max-off-policy-steps", "8",
                                 "--weights.update-interval", "3"])  # fmt: skip
    assert cfg.inference.max_loaded_loras == 8 // 3 + 2
    assert load_config(RLConfig, []).inference.max_loaded_loras == 4, "no lora: the engine's default"
    cfg = load_config(RLConfig, [*LORA, "--orchestrator.max-off-policy-steps", "1",
                                 "--inference.max-loaded-loras", "7"])  # fmt: skip
    assert cfg.inference.max_loaded_loras == 7, "an explicit value that suffices is kept"


def test_too_few_adapter_slots_are_refused_naming_both_keys() -> None:
    error = rl_error([*LORA, "--orchestrator.max-off-policy-steps", "8", "--inference.max-loaded-loras", "4"])
    assert "inference.max_loaded_loras = 4" in error and "orchestrator.max_off_policy_steps = 8" in error
    assert "= 10" in error


@pytest.mark.parametrize(
    ("argv", "keys"),
    [
        (
            ["--orchestrator.admission.unused-handler", "retry"],
            ("deterministic", "orchestrator.admission.unused_handler"),
        ),
        (["--orchestrator.sampling.top-p", "0.9"], ("orchestrator.sampling.top_p", "importance-ratio")),
    ],
)
def test_refused_combinations_name_both_keys(argv: list[str], keys: tuple[str, str]) -> None:
    error = rl_error(["--deterministic", "true", *argv])
    for key in keys:
        assert key in error


def test_deterministic_with_an_env_mix_is_refused() -> None:
    envs = [{"id": "reverse-text"}, {"id": "calculator"}]
    with pytest.raises(ValueError, match=r"deterministic = true with 2 orchestrator.envs"):
        OrchestratorConfig(deterministic=True, envs=envs)
    assert len(OrchestratorConfig(envs=envs).envs) == 2, "a mix alone trains"


def test_top_p_is_refused_for_training_only() -> None:
    with pytest.raises(ValueError, match=r"orchestrator.envs\[calculator\].sampling.top_p = 0.5"):
        OrchestratorConfig(envs=[{"id": "calculator", "sampling": {"top_p": 0.5}}])
    cfg = OrchestratorConfig(eval={"envs": [{"id": "reverse-text"}], "sampling": {"top_p": 0.5}})
    assert cfg.eval.sampling.top_p == 0.5, "eval episodes are never trained: any top_p"


def test_router_replay_is_copied_everywhere_and_refused_where_it_cannot_hold(tmp_path) -> None:
    """`router_replay` reaches all three components; a dense model, LoRA and the megatron backend are
    refused at start in one line naming both keys."""
    import json

    moe = ["--model.path", str(tmp_path / "moe"), "--model.build", "tiny_moe", "--router-replay", "true"]
    cfg = load_config(RLConfig, moe)
    assert cfg.inference.router_replay and cfg.trainer.router_replay
    assert cfg.orchestrator.inference.router_replay
    assert "router_replay = true with lora" in rl_error([*moe, *LORA])
    error = rl_error([*moe, "--trainer.backend", "megatron"])
    assert "router_replay = true with trainer.backend = 'megatron'" in error
    assert "model.build = 'tiny'" in rl_error(["--model.build", "tiny", "--router-replay", "true"])
    dense = tmp_path / "dense"
    dense.mkdir()
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (dense / "config.json").write_text(json.dumps(config))
    assert "(qwen3, dense)" in rl_error(["--model.path", str(dense), "--router-replay", "true"])


def test_lora_with_restarts_is_refused_with_something_the_user_can_do() -> None:
    error = rl_error([*LORA, "--restart.max-restarts", "1"])
    assert "set restart.max_restarts = 0" in error and "planned stop" in error
    assert "--resume" not in error, "rl has no --resume: the refusal must not point to it"
