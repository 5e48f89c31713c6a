"""Overflow is visible and handled: a multi-turn env (`guess_game`) on the tiny model whose third turn's
prompt outgrows `seq_len` (the renderers client refuses it; the harness ends the episode there).

The episode is flagged `overlong` with the turn and the prompt length, counted per env, warned once
naming env, turn and lengths, and the sink's `overlong` policy acts on it: `truncate` trains it up to
the turn that did not fit, `drop` drops it (filtered). Real verifiers episodes, real gateway, the tiny
model sampled by HF in-process; the orchestrator's real components (`build_components` + `run_loop`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from hf_engine import HFEngineClient

from prime_async.config.env import EnvConfig
from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.engine_api import SamplingParams
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.rollouts.env_sources import source_metrics
from prime_async.rollouts.verifiers_source import build_rollout_source
from prime_async.simulation import InMemoryBroadcasts
from prime_async.weights.loaders.filesystem import FilesystemLoader

pytest.importorskip("verifiers.v1")

SEQ_LEN = 256
# the first prompt is ~25 tokens, each hint ~125 and each reply <= 24: turn 2 fits, turn 3 cannot
ARGS = {"num_examples": 4, "max_turns": 4, "hint_words": 25, "stop_on_hit": False}


def test_a_third_turn_that_does_not_fit_is_flagged_counted_and_warned_once(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    engine = HFEngineClient(model_dir=str(tiny_model_dir), version=0)
    sampling = SamplingParams(temperature=1.0, max_tokens=24)

    async def main() -> tuple[list[Any], dict[str, float]]:
        env_cfg = EnvConfig(id="guess_game", name="guess", args=ARGS)
        async with build_rollout_source(
            env_cfg=env_cfg, engines=[engine], model_path=str(tiny_model_dir), seq_len=SEQ_LEN
        ) as source:
            episodes = [
                await source.run_episode(example_id=i, engine_key=str(i), sampling=sampling) for i in range(3)
            ]
            return episodes, source_metrics({"guess": source})

    episodes, metrics = asyncio.run(asyncio.wait_for(main(), timeout=240))
    for ep in episodes:
        assert ep.status == "ok", ep.error  # the env ended the episode cleanly at the refused turn
        assert ep.overlong and ep.truncated
        assert ep.metrics["overflow_turn"] == 3 and ep.metrics["overflow_prompt_tokens"] > SEQ_LEN
        assert ep.metrics["num_turns"] == 2 and len(ep.token_ids) <= SEQ_LEN
    assert metrics["env/guess/overflow_episodes"] == 3 == metrics["env/overflow_episodes"]
    warned = [r.message for r in caplog.records if "outgrew seq_len" in r.message]
    assert len(warned) == 1, warned
    prompt = episodes[0].metrics["overflow_prompt_tokens"]
    assert f"env guess: an episode outgrew seq_len = {SEQ_LEN}" in warned[0]
    assert f"turn 3's prompt is {prompt} tokens" in warned[0]


def _run(tmp_path: Path, model_dir: Path, overlong: str) -> list[dict[str, float]]:
    cfg = OrchestratorConfig.model_validate({
        "output_dir": str(tmp_path), "max_steps": 1, "seq_len": SEQ_LEN, "batch_groups": 1, "group_size": 2,
        "wandb": {"enabled": False}, "sampling": {"temperature": 1.0, "max_tokens": 24},
        "batch": {"sink": {"overlong": overlong}},
        "admission": {"max_dropped_groups_per_step": 2, "fail_fast_groups": 0},
        "envs": [{"id": "guess_game", "name": "guess", "args": ARGS}],
    })  # fmt: skip
    engine = HFEngineClient(model_dir=str(model_dir), version=0)
    logged: list[dict[str, float]] = []

    async def main() -> None:
        async with build_rollout_source(
            env_cfg=cfg.envs[0], engines=[engine], model_path=str(model_dir), seq_len=cfg.seq_len
        ) as source:
            comps = build_components(
                cfg,
                ComponentInputs(
                    source=source,
                    engines=[engine],
                    loader=FilesystemLoader(InMemoryBroadcasts()),
                    served_version=0,
                ),
            )

            async def send(batch: Any) -> None:
                pass

            def log(metrics: dict[str, float], step: int) -> None:  # as the orchestrator's own log_metrics
                logged.append({**metrics, **source_metrics({"guess": source})})

            await run_loop(cfg, comps, send_batch=send, log_metrics=log)

    asyncio.run(asyncio.wait_for(main(), timeout=240))
    return logged


@pytest.mark.timeout(300)
def test_sink_overlong_truncate_trains_the_episode_up_to_there(tiny_model_dir: Path, tmp_path: Path) -> None:
    [metrics] = _run(tmp_path, tiny_model_dir, "truncate")
    assert metrics["env/guess/overflow_episodes"] >= 2
    assert metrics["rollout/truncated_fraction"] == 1.0 and metrics["ledger/trained"] == 2


@pytest.mark.timeout(300)
def test_sink_overlong_drop_drops_the_episodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 2"):
        _run(tmp_path, tiny_model_dir, "drop")
