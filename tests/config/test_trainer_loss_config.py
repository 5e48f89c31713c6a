"""Trainer config: every loss variant by `loss.type`, `optim.num_steps_per_batch`, and the off-policy
warning (configured distance vs the loss's trust region)."""

from __future__ import annotations

import logging
import math

import pytest

from prime_async.config.loader import load_config
from prime_async.config.trainer import (
    DRIFT_PER_STEP,
    TrainerConfig,
    max_effective_steps,
    offpolicy_warning,
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--loss.type", "tis", "--loss.cap", "3"], {"cap": 3.0}),
        (["--loss.type", "cispo", "--loss.clip-high", "0.5"], {"clip_low": 1.0, "clip_high": 0.5}),
        (["--loss.type", "gspo"], {"clip_low": 3e-4, "clip_high": 4e-4}),
        (["--loss.type", "mis", "--loss.ratio-high", "4"], {"ratio_low": 0.5, "ratio_high": 4.0}),
    ],
)
def test_new_losses_by_type(args: list[str], expected: dict) -> None:
    cfg = load_config(TrainerConfig, args)
    assert cfg.loss.type == args[1]
    assert {k: getattr(cfg.loss, k) for k in expected} == expected


@pytest.mark.parametrize(
    "loss",
    [
        {"type": "tis", "cap": 0.5},
        {"type": "cispo", "clip_low": 1.5},
        {"type": "gspo", "clip_low": 1.0},
        {"type": "mis", "ratio_low": 2.0},
        {"type": "mis", "ratio_high": 0.5},
    ],
)
def test_loss_bounds(loss: dict) -> None:
    with pytest.raises(ValueError, match=next(k for k in loss if k != "type")):
        TrainerConfig.model_validate({"loss": loss})


@pytest.mark.parametrize("steps", [0, 257])
def test_num_steps_per_batch_bounds(steps: int) -> None:
    with pytest.raises(ValueError, match="num_steps_per_batch"):
        TrainerConfig.model_validate({"optim": {"num_steps_per_batch": steps}})


def test_max_effective_steps() -> None:
    assert max_effective_steps(None, 1) == 0  # synchronous, one step: on-policy
    assert max_effective_steps(0, 4) == 3  # the last of 4 mini-batches
    assert max_effective_steps(2, 3) == 8  # a token 2 versions old (6 steps) in the third mini-batch


def _cfg(loss: dict, k: int | None, steps: int, seq_len: int = 2048) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "loss": loss,
            "max_off_policy_steps": k,
            "optim": {"num_steps_per_batch": steps},
            "seq_len": seq_len,
        }
    )


@pytest.mark.parametrize(
    ("loss", "quiet", "loud"),
    [
        # mask [0.5, 2]: radius log 2 = 0.693 -> up to 13 steps at 0.05 per step
        ({"type": "mask"}, (13, 1), (6, 3)),
        # ppo_clip: radius -log(0.8) = 0.223 -> up to 4 steps
        ({"type": "ppo_clip"}, (0, 4), (1, 3)),
        # m2po: sqrt(0.04) = 0.2 -> up to 4 steps (4 itself sits on the edge)
        ({"type": "m2po"}, (3, 1), (5, 1)),
        # tis: log(cap) = log 4 = 1.386 -> up to 27 steps
        ({"type": "tis", "cap": 4.0}, (27, 1), (28, 1)),
        # cispo, no lower bound: log(1 + 1) = 0.693 -> up to 13 steps
        ({"type": "cispo"}, (13, 1), (0, 15)),
        # gspo's paper band (3e-4 on the geometric mean): only on-policy, one step, is quiet
        ({"type": "gspo"}, (0, 1), (1, 1)),
        # mis: log 2 over up to seq_len tokens (2048) -> only on-policy, one step, is quiet
        ({"type": "mis"}, (0, 1), (0, 2)),
    ],
    ids=lambda x: x["type"] if isinstance(x, dict) else str(x),
)
def test_offpolicy_warning_rule(loss: dict, quiet: tuple[int, int], loud: tuple[int, int]) -> None:
    assert offpolicy_warning(_cfg(loss, *quiet)) is None
    cfg = _cfg(loss, *loud)
    message = offpolicy_warning(cfg)
    distance = max_effective_steps(*loud)
    radius = cfg.loss.trust_region_radius(cfg.seq_len)
    assert distance * DRIFT_PER_STEP > radius and message is not None
    assert f"max_off_policy_steps = {loud[0]} with optim.num_steps_per_batch = {loud[1]}" in message
    assert f"up to {distance} optimizer steps" in message and f"loss.type = {loss['type']!r}" in message


def test_custom_loss_never_warns() -> None:
    cfg = _cfg({"type": "custom", "import_path": "a.b:c"}, 100, 8)
    assert cfg.loss.trust_region_radius(cfg.seq_len) is None and offpolicy_warning(cfg) is None


def test_warning_is_logged_at_validation(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prime_async.config.trainer"):
        _cfg({"type": "ppo_clip"}, 8, 1)
    assert "outruns the trust region of loss.type = 'ppo_clip' (|log ratio| <= 0.223)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prime_async.config.trainer"):
        _cfg({"type": "mask"}, 8, 1)
    assert caplog.text == ""


def test_radius_of_an_open_band_is_its_closed_side() -> None:
    cfg = _cfg({"type": "cispo", "clip_low": 1.0, "clip_high": 0.28}, 0, 1)
    assert cfg.loss.trust_region_radius(cfg.seq_len) == pytest.approx(math.log(1.28))
