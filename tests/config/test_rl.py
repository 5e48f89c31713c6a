"""`RLConfig`: shared fields and cross-component values propagate into the sub-configs; conflicts are errors.

Also checks the hand-off to the launcher: the sub-config files `rl` writes reload, through each command's
own loader, into exactly the sub-configs `rl` validated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_async.config.inference import InferenceConfig
from prime_async.config.loader import ConfigError, dump_toml, load_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.rl import RLConfig, explicit_values
from prime_async.config.shared import ModelConfig
from prime_async.config.trainer import TrainerConfig

SUBS = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as exc_info:
        load_config(RLConfig, argv)
    return str(exc_info.value)


def test_defaults_are_consistent_across_components() -> None:
    cfg = RLConfig()
    for name in SUBS:
        sub = getattr(cfg, name)
        assert (sub.model, sub.seq_len, sub.output_dir, sub.wandb, sub.log) == (
            cfg.model,
            cfg.seq_len,
            cfg.output_dir,
            cfg.wandb,
            cfg.log,
        ), name
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == cfg.max_steps
    assert cfg.trainer.transport == cfg.orchestrator.transport == cfg.transport
    assert cfg.orchestrator.inference.base_urls == ["http://127.0.0.1:30000"]
    assert cfg.trainer.max_off_policy_steps == cfg.orchestrator.max_off_policy_steps
    assert cfg.orchestrator.batch.packing.num_train_ranks == cfg.trainer.num_processes == 1
    assert cfg.orchestrator.inference.max_running_requests == cfg.inference.engine.max_running_requests


def test_shared_overrides_reach_every_component(tmp_path: Path) -> None:
    rl = write(
        tmp_path, "rl.toml", "seq_len = 384\nmax_steps = 7\n[model]\npath = 'm'\n[transport]\nport = 6001\n"
    )
    cfg = load_config(
        RLConfig, ["@", rl, "--output-dir", "runs/x", "--no-wandb.enabled", "--log.level", "DEBUG"]
    )
    for name in SUBS:
        sub = getattr(cfg, name)
        assert sub.seq_len == 384 and sub.model == ModelConfig(path="m"), name
        assert sub.output_dir == Path("runs/x") and not sub.wandb.enabled and sub.log.level == "DEBUG", name
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 7
    assert cfg.trainer.transport.port == cfg.orchestrator.transport.port == 6001


def test_log_level_is_case_insensitive(tmp_path: Path) -> None:
    rl = write(tmp_path, "rl.toml", "[log]\nlevel = 'warning'\n")
    cfg = load_config(RLConfig, ["@", rl, "--log.level", "debug"])
    assert {getattr(cfg, name).log.level for name in SUBS} == {"DEBUG"}
    assert load_config(RLConfig, ["@", rl]).log.level == "WARNING"


def test_cross_component_links() -> None:
    cfg = load_config(
        RLConfig,
        [
            "--inference.server.port", "31000",
            "--inference.engine.max-running-requests", "12",
            "--orchestrator.max-off-policy-steps", "3",
            "--trainer.num-processes", "2",
        ],
    )  # fmt: skip
    assert cfg.orchestrator.inference.base_urls == ["http://127.0.0.1:31000"]
    assert cfg.orchestrator.inference.max_running_requests == 12
    assert cfg.trainer.max_off_policy_steps == 3
    assert cfg.orchestrator.batch.packing.num_train_ranks == 2


def test_sglang_engines_and_exposed_host_with_api_key() -> None:
    cfg = load_config(
        RLConfig,
        [
            "--inference.backend", "sglang",
            "--inference.sglang.num-engines", "3",
            "--inference.sglang.max-running-requests", "48",
            "--inference.server.host", "0.0.0.0",
            "--inference.server.api-key", "secret",
        ],
    )  # fmt: skip
    assert cfg.orchestrator.inference.base_urls == [f"http://127.0.0.1:{30000 + i}" for i in range(3)]
    assert cfg.orchestrator.inference.api_key == "secret"
    assert cfg.orchestrator.inference.max_running_requests == 48


def test_section_files_merge_into_their_section(tmp_path: Path) -> None:
    trainer = write(tmp_path, "t.toml", "num_processes = 2\n[optim]\nlr = 2e-6\n")
    cfg = load_config(RLConfig, ["--trainer", "@", trainer, "--trainer.optim.warmup-steps", "3"])
    assert cfg.trainer.optim.lr == 2e-6 and cfg.trainer.optim.warmup_steps == 3
    assert cfg.orchestrator.batch.packing.num_train_ranks == 2


def test_explicit_equal_values_are_allowed(tmp_path: Path) -> None:
    trainer = write(tmp_path, "t.toml", "seq_len = 512\n[model]\npath = 'm'\n")
    cfg = load_config(RLConfig, ["--seq-len", "512", "--model.path", "m", "--trainer", "@", trainer])
    assert cfg.trainer.seq_len == 512 and cfg.trainer.model.path == "m"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--seq-len", "512", "--trainer.seq-len", "256"],
            "trainer.seq_len = 256 conflicts with seq_len = 512: rl copies seq_len into trainer.seq_len, "
            "so set only seq_len",
        ),
        (
            ["--orchestrator.model.path", "other"],
            "--orchestrator.model.path: orchestrator.model.path = 'other' conflicts with model.path = "
            "'models/tiny': rl copies model into orchestrator.model, so set only model.path",
        ),
        (
            ["--orchestrator.max-off-policy-steps", "2", "--trainer.max-off-policy-steps", "4"],
            "trainer.max_off_policy_steps = 4 conflicts with orchestrator.max_off_policy_steps = 2: "
            "rl copies orchestrator.max_off_policy_steps into trainer.max_off_policy_steps, so set only "
            "orchestrator.max_off_policy_steps",
        ),
        (
            ["--orchestrator.batch.packing.num-train-ranks", "4"],
            "--orchestrator.batch.packing.num-train-ranks: orchestrator.batch.packing.num_train_ranks = 4 "
            "conflicts with "
            "trainer.num_processes = 1: rl copies trainer.num_processes into "
            "orchestrator.batch.packing.num_train_ranks, so set only trainer.num_processes",
        ),
        (
            ["--orchestrator.inference.base-urls", '["http://10.0.0.1:8000"]'],
            "--orchestrator.inference.base-urls: orchestrator.inference.base_urls = ['http://10.0.0.1:8000'] "
            "conflicts with inference.server.host/port = ['http://127.0.0.1:30000']: rl copies "
            "inference.server.host/port into orchestrator.inference.base_urls, so set only "
            "inference.server.host/port",
        ),
        (
            ["--output-dir", "a", "--inference.output-dir", "b"],
            "inference.output_dir = 'b' conflicts with output_dir = 'a': rl copies output_dir into "
            "inference.output_dir, so set only output_dir",
        ),
        (
            ["--transport.port", "6000", "--trainer.transport.port", "6001"],
            "trainer.transport.port = 6001 conflicts with transport.port = 6000: rl copies transport into "
            "trainer.transport, so set only transport.port",
        ),
    ],
)
def test_conflicts_name_both_keys(argv: list[str], expected: str) -> None:
    assert load_error(argv) == expected


def test_conflict_from_a_section_file_names_the_file(tmp_path: Path) -> None:
    rl = write(tmp_path, "rl.toml", "seq_len = 512\n")
    trainer = write(tmp_path, "t.toml", "seq_len = 1024\n")
    assert load_error(["@", rl, "--trainer", "@", trainer]) == (
        "trainer.seq_len = 1024 conflicts with seq_len = 512: rl copies seq_len into trainer.seq_len, "
        "so set only seq_len"
    )
    assert load_error(["--trainer", "@", trainer]) == (
        f"{trainer}: trainer.seq_len = 1024 conflicts with seq_len = 2048: rl copies seq_len into "
        "trainer.seq_len, so set only seq_len"
    )


def test_invalid_sub_value_is_reported_by_validation_not_as_conflict() -> None:
    assert load_error(["--trainer.seq-len", "abc"]) == (
        "--trainer.seq-len: Input should be a valid integer, unable to parse string as an integer (got 'abc')"
    )
    assert load_error(["--seq-len", "4"]) == "--seq-len: Input should be greater than or equal to 8 (got '4')"


def test_sub_validators_see_propagated_values() -> None:
    # orchestrator rejects weights.update_interval > K + 1; K itself is set in the orchestrator section
    assert load_error(
        ["--orchestrator.max-off-policy-steps", "0", "--weights.update-interval", "2"]
    ).endswith(
        "orchestrator: weights.update_interval (2) > max_off_policy_steps + 1 (1): admission would wait "
        "for a version never loaded; lower weights.update_interval or raise max_off_policy_steps"
    )


def test_python_construction_propagates_and_checks() -> None:
    cfg = RLConfig(seq_len=512, trainer=TrainerConfig(num_processes=2))
    assert cfg.trainer.seq_len == cfg.orchestrator.seq_len == 512
    assert cfg.orchestrator.batch.packing.num_train_ranks == 2
    with pytest.raises(ValidationError, match=r"trainer\.seq_len = 256 conflicts with seq_len = 512"):
        RLConfig(seq_len=512, trainer=TrainerConfig(seq_len=256))


def test_dry_run_output_reloads_to_the_same_config(tmp_path: Path) -> None:
    cfg = load_config(
        RLConfig, ["--seq-len", "512", "--trainer.num-processes", "2", "--inference.server.port", "31001"]
    )
    again = load_config(RLConfig, ["@", write(tmp_path, "resolved.toml", dump_toml(cfg))])
    assert again == cfg


def test_launcher_sub_config_files_reload_into_each_command(tmp_path: Path) -> None:
    from prime_async.launcher.rl import write_sub_configs

    cfg = load_config(
        RLConfig,
        ["--seq-len", "640", "--max-steps", "3", "--output-dir", str(tmp_path / "run"), "--no-wandb.enabled",
         "--orchestrator.max-off-policy-steps", "2", "--inference.server.port", "31002"],
    )  # fmt: skip
    paths = write_sub_configs(cfg, tmp_path / "configs")
    for name, cls in SUBS.items():
        assert load_config(cls, ["@", str(paths[name])]) == getattr(cfg, name), name


def test_a_changed_config_propagates_again() -> None:
    cfg = RLConfig(trainer=TrainerConfig(num_processes=2))
    cfg = cfg.with_values(seq_len=640, max_steps=3)
    assert cfg.trainer.seq_len == cfg.orchestrator.seq_len == cfg.inference.seq_len == 640
    assert cfg.trainer.max_steps == cfg.orchestrator.max_steps == 3
    assert cfg.orchestrator.batch.packing.num_train_ranks == 2  # the given trainer value survived
    with pytest.raises(ValidationError):
        cfg.with_values(seq_len=4)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.seq_len = 4  # an assignment would not propagate: a change is a new config
    assert cfg.seq_len == cfg.trainer.seq_len == 640


def test_explicitly_set_dump_reloads() -> None:
    cfg = load_config(
        RLConfig, ["--seq-len", "512", "--trainer.num-processes", "2", "--inference.server.port", "1234"]
    )
    given = explicit_values(cfg)
    assert "seq_len" not in given["trainer"]  # propagated values are never given
    assert RLConfig.model_validate(given) == cfg


def test_a_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = write(tmp_path, "rl.toml", 'inference = "fast"\n')
    assert load_error(["@", path]) == (
        f"{path}: inference: Input should be a valid dictionary or instance of InferenceConfig (got 'fast')"
    )


def test_sections_given_as_instances_keep_their_union_variant() -> None:
    from prime_async.config.trainer import M2POLossConfig

    cfg = RLConfig(trainer=TrainerConfig(loss=M2POLossConfig()))  # `type` is a default, not "set"
    cfg = cfg.with_values(max_steps=4)
    assert cfg.trainer.loss == M2POLossConfig() and cfg.trainer.max_steps == 4
    assert RLConfig.model_validate(explicit_values(cfg)) == cfg


def test_deterministic_reaches_every_component_and_needs_the_newest_k_plus_1_broadcasts() -> None:
    k2 = ["--orchestrator.max-off-policy-steps", "2"]  # the default K = 8 needs keep_last >= 9
    cfg = load_config(RLConfig, ["--deterministic", "true", "--inference.backend", "sglang", *k2])
    assert cfg.inference.deterministic and cfg.orchestrator.deterministic and cfg.trainer.deterministic
    from prime_async.inference.sglang_launcher import build_launch_specs

    assert "--enable-deterministic-inference" in build_launch_specs(cfg.inference)[0].argv
    assert "--enable-deterministic-inference" not in build_launch_specs(RLConfig().inference)[0].argv
    assert not RLConfig().orchestrator.deterministic
    error = load_error(["--deterministic", "true", "--orchestrator.max-off-policy-steps", "3",
                        "--trainer.weights.keep-last", "3"])  # fmt: skip
    assert "trainer.weights.keep_last (3) must be >= orchestrator.max_off_policy_steps + 1 (4)" in error
    error = load_error(["--deterministic", "true", "--orchestrator.deterministic", "false", *k2])
    assert "orchestrator.deterministic = False conflicts with deterministic = True" in error


def test_weight_update_keys_moved_to_the_weights_section_are_named() -> None:
    message = load_error(["--orchestrator.pause-mode", "drain"])
    assert "did you mean 'weights.pause_mode'" in message, message
    with pytest.raises(ValidationError, match=r"update_weights_interval moved to weights\.update_interval"):
        OrchestratorConfig(update_weights_interval=2)
