"""Config of the environment mix, of eval while training and of dedicated eval engines under `rl`:
`[env]` is the loader's shorthand for `envs = [env]`, names are unique and metric-safe, per-env sampling
keeps the run's temperature, eval placements need (or refuse) eval URLs, `[eval_inference]` propagates
like the other sections and the sub-config files `rl` writes reload into the same configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_async.config.inference import InferenceConfig
from prime_async.config.loader import ConfigError, load_config
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.rl import RLConfig

ROOT = Path(__file__).resolve().parents[2]
EVAL_ENV = {"id": "reverse-text", "num_examples": 4}


def test_one_env_table_is_a_list_of_one_and_the_default_is_reverse_text(tmp_path: Path) -> None:
    path = tmp_path / "o.toml"
    path.write_text('[env]\nid = "calculator"\nratio = 2\n')
    cfg = load_config(OrchestratorConfig, ["@", str(path)])
    assert [(e.label, e.ratio) for e in cfg.envs] == [("calculator", 2.0)]
    assert "env" not in OrchestratorConfig.model_fields  # one form in the schema: the loader's shorthand
    assert OrchestratorConfig.model_validate(cfg.model_dump()) == cfg  # the dump reloads into the same
    assert [e.label for e in OrchestratorConfig().envs] == ["reverse-text"]
    rl = tmp_path / "rl.toml"
    rl.write_text('[orchestrator.env]\nid = "calculator"\n')
    assert [e.label for e in load_config(RLConfig, ["@", str(rl)]).orchestrator.envs] == ["calculator"]


def test_env_and_envs_together_name_both(tmp_path: Path) -> None:
    path = tmp_path / "o.toml"
    path.write_text('[env]\nid = "a"\n\n[[envs]]\nid = "b"\n')
    with pytest.raises(ConfigError, match="env and envs: give one item as `env` or a list as `envs`"):
        load_config(OrchestratorConfig, ["@", str(path)])


def test_a_flag_on_env_still_edits_a_file_with_env(tmp_path: Path) -> None:
    path = tmp_path / "o.toml"
    path.write_text('[env]\nid = "reverse-text"\nargs = { num_examples = 5 }\n')
    cfg = load_config(OrchestratorConfig, ["@", str(path), "--env.name", "rt"])
    assert [(e.label, e.args) for e in cfg.envs] == [("rt", {"num_examples": 5})]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"envs": [{"id": "a"}, {"id": "a"}]}, r"envs\[1\].name: 'a' is used twice"),
        ({"envs": [{"id": "a", "name": "x/y"}]}, "an environment name must start with a letter"),
        ({"envs": [{"id": "seat"}]}, "not be one of"),
        ({"envs": [{"id": "a", "ratio": 0}]}, "greater than 0"),
        ({"envs": []}, "at least 1 item"),
        ({"envs": [{"id": "a", "sampling": {"temperature": 0.7}}]}, "keeps orchestrator"),
        ({"eval": {"envs": [EVAL_ENV], "base_urls": ["http://x"]}}, "shared placement evaluates on the"),
        ({"eval": {"envs": [EVAL_ENV], "placement": "external"}}, "needs the eval engines' URLs"),
        ({"eval": {"envs": [EVAL_ENV, EVAL_ENV]}}, r"eval.envs\[1\].name"),
    ],
)
def test_bad_mix_or_eval_config_is_one_error_naming_the_key(data: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        OrchestratorConfig.model_validate(data)


def test_eval_envs_may_change_the_temperature() -> None:
    cfg = OrchestratorConfig(eval={"envs": [{**EVAL_ENV, "sampling": {"temperature": 0.0}}], "interval": 2})
    assert cfg.eval.enabled and cfg.eval.envs[0].sampling.temperature == 0.0


def dedicated(**extra) -> dict:
    eval_cfg = {"placement": "dedicated", "envs": [EVAL_ENV]}
    return {"eval_inference": {"server": {"port": 31500}}, "orchestrator": {"eval": eval_cfg}, **extra}


def test_eval_inference_gets_the_shared_fields_and_gives_its_urls_to_the_orchestrator() -> None:
    cfg = RLConfig.model_validate(dedicated(seq_len=320, model={"path": "m"}))
    assert cfg.eval_inference is not None
    assert (cfg.eval_inference.seq_len, cfg.eval_inference.model.path) == (320, "m")
    assert cfg.orchestrator.eval.base_urls == ["http://127.0.0.1:31500"]
    cfg = cfg.with_values(seq_len=400)  # propagates again
    assert cfg.eval_inference.seq_len == 400


def test_eval_inference_needs_the_dedicated_placement_and_its_urls_are_rls() -> None:
    with pytest.raises(ValidationError, match=r"only for orchestrator\.eval\.placement = 'dedicated'"):
        RLConfig.model_validate({"eval_inference": {}})
    conflict = dedicated()
    conflict["orchestrator"]["eval"]["base_urls"] = ["http://127.0.0.1:1"]
    with pytest.raises(ValidationError, match=r"conflicts with eval_inference\.server\.host/port"):
        RLConfig.model_validate(conflict)


def test_rl_writes_sub_configs_that_reload_into_the_same_configs(tmp_path: Path) -> None:
    from prime_async.launcher.rl import write_sub_configs

    argv = ["@", str(ROOT / "configs/tiny/rl_mix.toml"), "--orchestrator.eval.placement", "dedicated",
            "--eval-inference.server.port", "31501", "--output-dir", str(tmp_path)]  # fmt: skip
    cfg = load_config(RLConfig, argv)
    paths = write_sub_configs(cfg, tmp_path / "configs")
    assert load_config(OrchestratorConfig, ["@", str(paths["orchestrator"])]) == cfg.orchestrator
    assert load_config(InferenceConfig, ["@", str(paths["eval_inference"])]) == cfg.eval_inference
    assert [e.label for e in cfg.orchestrator.envs] == ["reverse-text", "calculator"]
    assert cfg.orchestrator.eval.base_urls == ["http://127.0.0.1:31501"]


def test_a_key_unknown_to_an_env_item_names_it() -> None:
    with pytest.raises(ConfigError, match=r"envs\[0\]\.idd: unknown key"):
        load_config(OrchestratorConfig, ["--envs", '[{"idd": "a"}]'])
