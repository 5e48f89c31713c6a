"""The config loader against a small demo schema: merge order, CLI overrides, --help, --dry-run, bad input."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from loader_schemas import DemoConfig, ShorthandDemo

from prime_async.config.loader import ConfigError, dump_toml, load_config, parse_config


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory so that file names in messages are short and exact."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(name: str, text: str) -> str:
    Path(name).write_text(text)
    return name


def test_defaults_without_arguments():
    assert load_config(DemoConfig, []) == DemoConfig()


def test_files_deep_merge_left_to_right(in_tmp):
    write("a.toml", 'name = "a"\nseq_len = 64\ntags = ["x", "y"]\n[optim]\nlr = 1.0\nmax_norm = 0.5\n')
    write("b.toml", 'name = "b"\ntags = ["z"]\n[optim]\nlr = 2.0\n')
    cfg = load_config(DemoConfig, ["@", "a.toml", "@b.toml"])
    assert cfg.name == "b"  # later file wins
    assert cfg.seq_len == 64  # kept from the earlier file
    assert cfg.tags == ["z"]  # lists replace, they do not concatenate
    assert (cfg.optim.lr, cfg.optim.max_norm) == (2.0, 0.5)  # tables merge key by key
    reverse = load_config(DemoConfig, ["@", "b.toml", "@", "a.toml"])
    assert (reverse.name, reverse.optim.lr) == ("a", 1.0)


def test_cli_overrides_files_wherever_it_stands(in_tmp):
    write("a.toml", "seq_len = 64\n[optim]\nlr = 1.0\n")
    cfg = load_config(DemoConfig, ["--optim.lr", "3e-6", "@", "a.toml", "--seq-len", "96"])
    assert (cfg.optim.lr, cfg.seq_len) == (3e-6, 96)


def test_nested_kebab_and_snake_case_overrides():
    cfg = load_config(
        DemoConfig, ["--optim.max-norm", "0.25", "--max_off_policy_steps", "3", "--batch-groups=2"]
    )
    assert (cfg.optim.max_norm, cfg.max_off_policy_steps, cfg.batch_groups) == (0.25, 3, 2)


def test_kebab_case_keys_in_files(in_tmp):
    write("a.toml", "max-off-policy-steps = 5\n[optim]\nmax-norm = 2.0\n")
    cfg = load_config(DemoConfig, ["@", "a.toml"])
    assert (cfg.max_off_policy_steps, cfg.optim.max_norm) == (5, 2.0)


@pytest.mark.parametrize(
    ("argv", "enabled"),
    [
        (["--no-wandb.enabled"], False),
        (["--no-wandb.enabled", "--wandb.enabled"], None),  # conflicting: checked below
        (["--wandb.enabled"], True),
        (["--wandb.enabled", "false"], False),
        (["--wandb.enabled=0"], False),
        (["--wandb.enabled", "true", "--seq-len", "64"], True),
    ],
)
def test_boolean_flags(argv, enabled):
    if enabled is None:
        with pytest.raises(ConfigError, match="set twice on the command line"):
            load_config(DemoConfig, argv)
        return
    assert load_config(DemoConfig, argv).wandb.enabled is enabled


def test_boolean_flag_does_not_swallow_a_file(in_tmp):
    write("a.toml", "seq_len = 64\n")
    cfg = load_config(DemoConfig, ["--no-wandb.enabled", "@", "a.toml", "--wandb.group", "g"])
    assert (cfg.wandb.enabled, cfg.seq_len, cfg.wandb.group) == (False, 64, "g")


def test_json_lists_dicts_and_null():
    cfg = load_config(
        DemoConfig,
        ["--tags", '["a", "b"]', "--optim.betas", "[0.5, 0.6]", "--env-args", '{"n": 3, "tool": "calc"}'],
    )
    assert (cfg.tags, cfg.optim.betas, cfg.env_args) == (["a", "b"], [0.5, 0.6], {"n": 3, "tool": "calc"})
    cfg = load_config(DemoConfig, ["--env_args.num-examples", "7", "--env_args.split", "train"])
    assert cfg.env_args == {"num-examples": 7, "split": "train"}  # free-form keys are kept verbatim
    assert load_config(DemoConfig, ["--max-buffered-groups", "null"]).max_buffered_groups is None
    assert load_config(DemoConfig, ["--name", "[not json]"]).name == "[not json]"  # strings stay strings


def test_schema_fields_take_pydantic_settings_list_and_dict_forms():
    """A schema field's text is pydantic-settings' to parse: `a,b` and one word are lists, `k=v` a dict."""
    assert load_config(DemoConfig, ["--tags", "a,b"]).tags == ["a", "b"]
    assert load_config(DemoConfig, ["--tags", "a"]).tags == ["a"]
    assert load_config(DemoConfig, ["--optim.betas", "0.1,0.2"]).optim.betas == [0.1, 0.2]
    assert load_config(DemoConfig, ["--env-args", "split=train"]).env_args == {"split": "train"}


def test_union_section_without_its_tag_takes_the_default_variant():
    """`--schedule.x` without `--schedule.type` keeps the default's tag (`BaseConfig._one_form`)."""
    with pytest.raises(ConfigError, match=r"^--schedule\.min-ratio: unknown key$"):
        load_config(DemoConfig, ["--schedule.min-ratio", "0.2"])  # the default variant has no min_ratio
    assert load_config(DemoConfig, ["--schedule", '{"type": "cosine"}']).schedule.min_ratio == 0.1


def test_union_section_by_cli_and_file(in_tmp):
    cfg = load_config(DemoConfig, ["--schedule.type", "cosine", "--schedule.min-ratio", "0.2"])
    assert cfg.schedule.type == "cosine" and cfg.schedule.min_ratio == 0.2
    write("s.toml", 'type = "cosine"\nmin_ratio = 0.3\n')
    assert load_config(DemoConfig, ["--schedule", "@", "s.toml"]).schedule.min_ratio == 0.3


def test_shorthand_item_by_flags_json_and_file(in_tmp):
    """`--item.lr` / `--item '{...}'` / `[item]` are the one-item spelling of `items` (`orchestrator.env`)."""
    assert load_config(ShorthandDemo, ["--item.lr", "0.5"]).items[0].lr == 0.5
    assert load_config(ShorthandDemo, ["--item", '{"lr": 0.25, "betas": [0.1, 0.2]}']).items[0].betas == [
        0.1,
        0.2,
    ]
    write("s.toml", "[item]\nlr = 0.75\n")
    assert [o.lr for o in load_config(ShorthandDemo, ["@", "s.toml"]).items] == [0.75]
    with pytest.raises(ConfigError, match="give one item as `item` or a list as `items`"):
        load_config(ShorthandDemo, ["@", "s.toml", "--items", '[{"lr": 1}]'])


def test_section_file_merges_under_its_key(in_tmp):
    write("optim.toml", "lr = 0.5\n")
    write("a.toml", "[optim]\nlr = 0.1\nmax_norm = 3.0\n")
    cfg = load_config(DemoConfig, ["@", "a.toml", "--optim", "@optim.toml"])
    assert (cfg.optim.lr, cfg.optim.max_norm) == (0.5, 3.0)


def test_dry_run_prints_toml_that_round_trips(in_tmp, capsys):
    write("a.toml", "seq_len = 64\n[optim]\nlr = 0.5\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DemoConfig, ["@", "a.toml", "--dry-run", "--tags", '["t"]'], prog="demo")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    resolved = tomllib.loads(text)
    assert resolved["seq_len"] == 64 and resolved["optim"]["lr"] == 0.5
    assert "max_buffered_groups" not in resolved  # None values are dropped
    write("resolved.toml", text)
    assert load_config(DemoConfig, ["@", "resolved.toml"]) == load_config(
        DemoConfig, ["@", "a.toml", "--tags", '["t"]']
    )
    assert dump_toml(DemoConfig()) == dump_toml(load_config(DemoConfig, []))


def test_help_lists_every_field_with_type_default_and_description(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DemoConfig, ["--seq-len", "bogus", "--help"], prog="demo")  # --help wins
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: demo [@ FILE.toml ...]")
    for line in (  # pydantic-settings' argparse help: flag, type, description, default
        "--seq-len int",
        "Max tokens per sample. (default: 128)",
        "--optim.lr float",
        "Learning rate. (default: 1e-06)",
        "--max-buffered-groups {int,null}",
        "--mode {sync,async}",
        "Run mode. (default: async)",
        "--schedule [JSON]",
        "--schedule.min-ratio float",
        "Variant tag. (default: constant)",  # the section's default variant, not the last one
        "--wandb.enabled, --no-wandb.enabled",
    ):
        assert line in text, line
    assert "Gradient clipping norm." in text and "Environment keyword arguments." in text
    assert "--section @ FILE.toml merges FILE into one section" in text


def test_parse_config_returns_the_config():
    assert parse_config(DemoConfig, ["--seq-len", "16"], prog="demo").seq_len == 16


# Each kind of bad input, with its exact one-line message.
FILES = {
    "neg.toml": "max_off_policy_steps = -1\n",
    "unknown.toml": "[optim]\nlrr = 2e-6\n",
    "misplaced.toml": "lr = 1\n",
    "type.toml": 'seq_len = "long"\n',
    "syntax.toml": "seq_len = 64\n[optim\nlr = 1\n",
    "dup.toml": "seq_len = 64\nseq_len = 65\n",
    "cross.toml": "batch_groups = 8\nmax_buffered_groups = 4\n",
    "literal.toml": 'mode = "fast"\n',
    "range.toml": '[schedule]\ntype = "cosine"\nmin_ratio = 2\n',
    "a.toml": "seq_len = 64\n",
}
BAD_INPUT = [
    ("out of range in a file", ["@", "neg.toml"],
     "neg.toml: max_off_policy_steps: Input should be greater than or equal to 0 (got -1)"),
    ("out of range in a union section", ["@", "range.toml"],
     "range.toml: schedule.min_ratio: Input should be less than or equal to 1 (got 2)"),
    ("unknown key in a file", ["@", "unknown.toml"],
     "unknown.toml: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("key at the wrong level", ["@", "misplaced.toml"],
     "misplaced.toml: unknown key 'lr' (did you mean 'optim.lr'?)"),
    ("unknown flag", ["--optim.lrr", "1"], "--optim.lrr: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("wrong type in a file", ["@", "type.toml"],
     "type.toml: seq_len: Input should be a valid integer, unable to parse string as an integer "
     "(got 'long')"),
    ("wrong type on the CLI", ["--seq-len", "abc"],
     "--seq-len: Input should be a valid integer, unable to parse string as an integer (got 'abc')"),
    ("bad literal", ["@", "literal.toml"],
     "literal.toml: mode: Input should be 'sync' or 'async' (got 'fast')"),
    ("bad boolean", ["--wandb.enabled", "maybe"],
     "--wandb.enabled: Input should be a valid boolean, unable to interpret input (got 'maybe')"),
    ("missing file", ["@", "missing.toml"], "config file not found: missing.toml"),
    ("TOML syntax error", ["@", "syntax.toml"],
     "syntax.toml: TOML syntax error: Expected ']' at the end of a table declaration (at line 2, column 7)"),
    ("duplicate key in a file", ["@", "dup.toml"],
     "dup.toml: TOML syntax error: duplicate key: Cannot overwrite a value (at line 2, column 13)"),
    ("flag without value", ["--seq-len"], "--seq-len needs a value"),
    ("flag followed by a flag", ["--seq-len", "--name", "x"], "--seq-len needs a value"),
    ("bad JSON for a list", ["--optim.betas", "[0.9,"],
     "--optim.betas: Parsing error encountered for optim.betas: Missing end delimiter \"]\""),
    ("@ without a file", ["@"], "'@' must be followed by a TOML file path"),
    ("@ followed by a flag", ["@", "--seq-len", "3"], "'@' must be followed by a TOML file path"),
    ("section @ without a file", ["--optim", "@"], "'@' after --optim must be followed by a TOML file path"),
    ("conflicting CLI values", ["--seq-len", "64", "--seq_len", "65"],
     "'seq_len' is set twice on the command line: --seq-len '64' and --seq_len '65'"),
    ("section and key both on the CLI", ["--optim", '{"lr": 1}', "--optim.lr", "2"],
     "conflicting flags --optim and --optim.lr: one sets part of the other"),
    ("cross-field check from a file", ["@", "cross.toml"],
     "cross.toml: max_buffered_groups (4) < batch_groups (8): set max_buffered_groups >= batch_groups"),
    ("cross-field check from flags", ["--batch-groups", "8", "--max-buffered-groups", "4"],
     "max_buffered_groups (4) < batch_groups (8): set max_buffered_groups >= batch_groups"),
    ("--no- on a non-boolean", ["--no-seq-len"], "--no-seq-len: 'seq_len' is not a boolean"),
    ("--no- with a value", ["--no-wandb.enabled=1"], "--no-wandb.enabled takes no value"),
    ("stray positional argument", ["run.toml"],
     "unexpected argument 'run.toml' (config files start with '@', overrides with '--')"),
    ("file into a scalar", ["--seq-len", "@", "a.toml"],
     "--seq-len: 'seq_len' is not a section, a TOML file cannot be merged into it"),
    ("section file with root keys", ["--optim", "@", "a.toml"],
     "a.toml: unknown key 'optim.seq_len' (did you mean 'seq_len'?)"),
    ("key below a scalar", ["--seq-len.x", "1"],
     "--seq-len.x: 'seq_len' is not a section (type int), it has no key 'x'"),
    ("empty flag", ["--", "x"], "empty flag '--'"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "argv", "message"), BAD_INPUT, ids=[case[0] for case in BAD_INPUT])
def test_bad_input_has_one_exact_line(in_tmp, kind, argv, message):
    for name, text in FILES.items():
        write(name, text)
    with pytest.raises(ConfigError) as err:
        load_config(DemoConfig, argv)
    assert str(err.value) == message
    assert "\n" not in str(err.value)


def test_parse_config_exits_2_with_prog_prefix(in_tmp, capsys):
    write("neg.toml", FILES["neg.toml"])
    with pytest.raises(SystemExit) as exit_info:
        parse_config(DemoConfig, ["@", "neg.toml"], prog="demo")
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "demo: error: neg.toml: max_off_policy_steps: Input should be greater than or equal to 0 (got -1)\n"
    )
