"""`MegatronConfig` validation: clear one-line errors at config validation time, before any process starts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from prime_async.config.megatron import MegatronConfig, validate_megatron_setup

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "hidden_size": 128,
    "vocab_size": 1024,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


def _model_dir(tmp_path: Path, **overrides) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, **overrides}))
    return tmp_path


@pytest.fixture
def with_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the extra is installed, so these checks run without importing it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name.startswith("megatron") else real(name, *a),
    )


def test_missing_extra_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("megatron") else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"needs megatron-core: install the extra with `uv sync --extra megatron"
    ):
        validate_megatron_setup(MegatronConfig(), _model_dir(tmp_path))


@pytest.mark.usefixtures("with_megatron")
def test_supported_setup_passes(tmp_path: Path) -> None:
    validate_megatron_setup(
        MegatronConfig(tensor_parallel_size=2, pipeline_parallel_size=3), _model_dir(tmp_path)
    )


@pytest.mark.usefixtures("with_megatron")
@pytest.mark.parametrize(
    ("cfg", "overrides", "message"),
    [
        ({}, {"architectures": ["GPT2LMHeadModel"]}, r"architecture 'GPT2LMHeadModel' .* is not supported"),
        ({"expert_parallel_size": 2}, {}, r"expert_parallel_size = 2 needs an MoE model"),
        (
            {"expert_parallel_size": 3},
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4},
            r"expert_parallel_size = 3 must divide the model's 4 experts",
        ),
        (
            {"tensor_parallel_size": 2},
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4},
            r"tensor_parallel_size = 2 with an MoE model: megatron-core needs sequence parallelism",
        ),
        ({"tensor_parallel_size": 3}, {}, r"tensor_parallel_size = 3 must divide num_attention_heads = 4"),
        ({"tensor_parallel_size": 4}, {}, r"and num_key_value_heads = 2; pick a divisor of 2"),
        ({"pipeline_parallel_size": 2}, {}, r"pipeline_parallel_size = 2 must divide num_hidden_layers = 3"),
        ({}, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn' is not supported"),
        (
            {},
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
            r"llama3 rope parameters",
        ),
    ],
)
def test_unsupported_setups_fail_early(tmp_path: Path, cfg: dict, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_megatron_setup(MegatronConfig(**cfg), _model_dir(tmp_path, **overrides))


@pytest.mark.usefixtures("with_megatron")
def test_sequence_parallel_is_refused_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sequence_parallel = true needs TransformerEngine"):
        validate_megatron_setup(MegatronConfig(sequence_parallel=True), _model_dir(tmp_path))


def test_parallel_sizes_are_bounded() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        MegatronConfig(tensor_parallel_size=0)


@pytest.mark.usefixtures("with_megatron")
def test_trainer_config_validates_the_megatron_setup(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from prime_async.config.trainer import TrainerConfig

    model = {"path": str(_model_dir(tmp_path))}
    ok = TrainerConfig(backend="megatron", model=model, megatron={"tensor_parallel_size": 2})
    assert ok.megatron.tensor_parallel_size == 2
    with pytest.raises(ValidationError, match="tensor_parallel_size = 3 must divide num_attention_heads"):
        TrainerConfig(backend="megatron", model=model, megatron={"tensor_parallel_size": 3})
    with_ckpt = TrainerConfig(backend="megatron", model=model, ckpt={"interval": 5, "resume": True})
    assert with_ckpt.ckpt.interval == 5  # sharded checkpoints (trainer/megatron/checkpoint.py)
    # The default backend never looks at the megatron section.
    assert TrainerConfig(model=model, megatron={"tensor_parallel_size": 3}).backend == "fsdp"
