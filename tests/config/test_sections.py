"""The sections of the orchestrator's and the trainer's keys: at most 20 keys per class, and every key that
moved into a section refused at its old place with one line naming its new key: by the schema (Python
construction), by the loader for a file key and a flag of the component's own command, and by `rl` for a
flag under the component's section (a key `rl` copies into the section names `rl`'s own key)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from prime_async.config.loader import ConfigError, load_config
from prime_async.config.orchestrator import MOVED_KEYS as ORCHESTRATOR_MOVED
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.config.rl import MOVED_KEYS as RL_MOVED
from prime_async.config.rl import SHARED_FIELDS, RLConfig
from prime_async.config.trainer import MOVED_KEYS as TRAINER_MOVED
from prime_async.config.trainer import TrainerConfig

MOVED = [
    *[("orchestrator", OrchestratorConfig, old, new) for old, new in ORCHESTRATOR_MOVED.items()],
    *[("trainer", TrainerConfig, old, new) for old, new in TRAINER_MOVED.items()],
    *[("rl", RLConfig, old, new) for old, new in RL_MOVED.items()],
]
IDS = [f"{section}.{old}" for section, _, old, _ in MOVED]


@pytest.mark.parametrize("cls", [OrchestratorConfig, TrainerConfig, RLConfig])
def test_at_most_20_keys_per_class(cls: type[BaseModel]) -> None:
    assert len(cls.model_fields) <= 20, sorted(cls.model_fields)


@pytest.mark.parametrize(("section", "cls", "old", "new"), MOVED, ids=IDS)
def test_a_moved_key_names_its_new_key(
    section: str, cls: type[BaseModel], old: str, new: str, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match=re.escape(f"{old} moved to {new} (the {section}'s settings")):
        cls.model_validate({old: 1})
    path = tmp_path / "c.toml"
    path.write_text(f"{old} = 1\n")
    with pytest.raises(ConfigError, match=re.escape(f"unknown key '{old}' (did you mean '{new}'?)")):
        load_config(cls, ["@", str(path)])
    flag = f"--{old.replace('_', '-')}"
    with pytest.raises(ConfigError, match=re.escape(f"(did you mean '{new}'?)")):
        load_config(cls, [flag, "1"])


@pytest.mark.parametrize(
    ("section", "cls", "old", "new"), [m for m in MOVED if m[0] != "rl"], ids=IDS[: -len(RL_MOVED)]
)
def test_a_moved_key_under_rl_names_its_key_there(section: str, cls: type, old: str, new: str) -> None:
    """Under `rl` the hint is the key to set: `rl`'s own for what it copies into the section."""
    first = new.split(".", 1)[0]
    hint = old if old in SHARED_FIELDS else f"{section}.{first}" if first == old else f"{section}.{new}"
    if old == "pause_mode":
        hint = new  # rl's own [weights] section, copied into the orchestrator's
    with pytest.raises(ConfigError, match=re.escape(f"(did you mean '{hint}'?)")):
        load_config(RLConfig, [f"--{section}.{old}", "1"])
