"""The env's own values are shown: every `@vf.metric` and every reward function of an env reaches the
step metrics (`env/<name>/metric/<metric>`, `env/<name>/reward_fn/<reward>`, the mean over the batch) and
`metrics/episodes.jsonl` (`metrics`, `rewards` by the env's names).

The real orchestrator components (`build_components` + `run_loop`) over the real reverse-text env (reward
`lcs`, metric `exact`) on the tiny model sampled by HF in-process; the eval side is covered by
`tests/eval/test_command.py` (eval.jsonl, samples, the wandb table).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hf_engine import HFEngineClient

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.episode_log import EpisodeLog
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.rollouts.verifiers_source import build_rollout_source
from prime_async.simulation import InMemoryBroadcasts
from prime_async.weights.loaders.filesystem import FilesystemLoader

pytest.importorskip("verifiers.v1")


@pytest.mark.timeout(300)
def test_env_metric_and_reward_functions_reach_step_metrics_and_episodes_jsonl(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = OrchestratorConfig.model_validate({
        "output_dir": str(tmp_path), "max_steps": 2, "seq_len": 256, "batch_groups": 2, "group_size": 2,
        "wandb": {"enabled": False}, "sampling": {"temperature": 1.0, "max_tokens": 8},
        "envs": [{"id": "reverse-text", "name": "rev", "args": {"num_examples": 8}}],
    })  # fmt: skip
    engine = HFEngineClient(model_dir=str(tiny_model_dir), version=0)
    logged: list[dict[str, float]] = []

    async def main() -> None:
        episode_log = EpisodeLog(tmp_path)
        async with build_rollout_source(
            env_cfg=cfg.envs[0], engines=[engine], model_path=str(tiny_model_dir), seq_len=cfg.seq_len
        ) as source:
            comps = build_components(
                cfg, ComponentInputs(source=source, engines=[engine],
                                     loader=FilesystemLoader(InMemoryBroadcasts()), served_version=0,
                                     episode_log=episode_log),
            )  # fmt: skip

            async def send(batch: Any) -> None:
                pass

            await run_loop(cfg, comps, send_batch=send, log_metrics=lambda m, s: logged.append(dict(m)))
        episode_log.close()

    asyncio.run(asyncio.wait_for(main(), timeout=240))
    assert len(logged) == 2
    for metrics in logged:
        assert (
            0.0 <= metrics["env/rev/reward_fn/lcs"] <= 1.0 and 0.0 <= metrics["env/rev/metric/exact"] <= 1.0
        )
        # one reward function of weight 1: its mean is the env's mean reward
        assert metrics["env/rev/reward_fn/lcs"] == pytest.approx(metrics["reward/rev/mean"])
    lines = [json.loads(x) for x in (tmp_path / "metrics" / "episodes.jsonl").read_text().splitlines()]
    assert len(lines) >= 8
    for line in lines:
        assert set(line["metrics"]) == {"exact"} and set(line["rewards"]) == {"lcs"}
        assert line["rewards"]["lcs"] == pytest.approx(line["reward"]) and line["overflow_turn"] is None
