"""OrchestratorConfig: derived defaults, cross-field checks, and every orchestrator TOML under configs/."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_async.config.loader import ConfigError, load_config
from prime_async.config.orchestrator import OrchestratorConfig

ROOT = Path(__file__).resolve().parents[2]


def test_derived_defaults():
    cfg = OrchestratorConfig(
        batch_groups=8, group_size=4, inference={"base_urls": ["a", "b"], "max_running_requests": 64}
    )
    assert cfg.resolved_max_inflight_groups == 39  # ceil(64 * 2 * 1.2 / 4) = ceil(38.4)
    assert cfg.resolved_max_buffered_groups == 72  # (K + 1) * batch_groups: the K + 1 batches that can ship
    sync = OrchestratorConfig(batch_groups=8, max_off_policy_steps=0, inference={"base_urls": ["a"]})
    assert sync.resolved_max_buffered_groups == 8  # one batch, no warning
    assert cfg.resolved_max_dropped_groups_per_step == 80
    assert cfg.max_off_policy_steps == 8


def test_buffer_below_batch_is_rejected_naming_the_key():
    with pytest.raises(ValidationError, match="max_buffered_groups"):
        OrchestratorConfig(batch_groups=8, admission={"max_buffered_groups": 7})


def test_interval_beyond_k_is_rejected():
    with pytest.raises(ValidationError, match=r"weights\.update_interval"):
        OrchestratorConfig(max_off_policy_steps=1, weights={"update_interval": 3})
    OrchestratorConfig(max_off_policy_steps=1, weights={"update_interval": 2})


def test_k_below_buffer_depth_is_a_lint_warning(caplog):
    """A buffer deeper than K + 1 batches validates quietly; the configuration lint names it."""
    from prime_async.config.lint import lint_orchestrator

    with caplog.at_level(logging.WARNING):
        deep = OrchestratorConfig(
            batch_groups=4, admission={"max_buffered_groups": 16}, max_off_policy_steps=2
        )
    assert caplog.text == "", "the lint warns, not the validator"
    assert [f.id for f in lint_orchestrator(deep)] == ["lint/buffer-deeper-than-k"]
    filled = [
        OrchestratorConfig(batch_groups=4, admission={"max_buffered_groups": 16}, max_off_policy_steps=3),
        # sync: one batch
        OrchestratorConfig(batch_groups=4, admission={"max_buffered_groups": 4}, max_off_policy_steps=0),
    ]
    assert all("lint/buffer-deeper-than-k" not in [f.id for f in lint_orchestrator(c)] for c in filled)


def test_negative_k_and_unknown_keys_rejected():
    with pytest.raises(ValidationError):
        OrchestratorConfig(max_off_policy_steps=-1)
    with pytest.raises(ValidationError):
        OrchestratorConfig(max_offpolicy_steps=1)


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*/orchestrator*.toml")), ids=str)
def test_every_orchestrator_toml_parses(path: Path):
    cfg = load_config(OrchestratorConfig, ["@", str(path)])
    assert cfg.resolved_max_buffered_groups >= cfg.batch_groups


@pytest.mark.parametrize(
    ("old", "new"),
    [("max_buffered_groups", "admission.max_buffered_groups"), ("unused_handler", "admission.unused_handler"),
     ("num_train_ranks", "batch.packing.num_train_ranks"),
     ("share_prompt_prefix", "batch.packing.share_prompt_prefix")],
)  # fmt: skip
def test_keys_moved_into_sections_name_their_new_key(old: str, new: str, tmp_path: Path) -> None:
    """Given at its old place, a key is refused with one line naming the new key: by the loader (file
    keys and flags) and by the schema (Python construction)."""
    with pytest.raises(ValidationError, match=re.escape(f"{old} moved to {new}")):
        OrchestratorConfig.model_validate({old: 1})
    path = tmp_path / "o.toml"
    path.write_text(f"{old} = 1\n")
    with pytest.raises(ConfigError, match=re.escape(f"did you mean '{new}'")):
        load_config(OrchestratorConfig, ["@", str(path)])
