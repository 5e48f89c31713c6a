"""Bad environment output at the orchestrator level: the real components (`build_components` + `run_loop`)
drive real verifiers episodes of reverse-text on the tiny model (in-process HF engine from
tests/environments) while the reward function raises, returns NaN or None on a schedule and completions
hit `seq_len`.

Per-episode behaviour (each fault -> status "error", `env_error` kind) is tested in
tests/environments/test_episodes.py; here: the run goes on to `max_steps`, each fault is counted under its
reason (`env/errors/reward`, ledger `errored`, overlong truncation), errored groups are retried, the
ledger balances every step and no trained episode carries an error or a non-finite reward.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments"))
from hf_engine import HFEngineClient

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.rollouts.verifiers_source import build_rollout_source
from prime_async.simulation import InMemoryBroadcasts
from prime_async.weights.loaders.filesystem import FilesystemLoader

pytest.importorskip("verifiers.v1")
FLAKY = Path(__file__).parent / "flaky_rewards.py"
BUCKETS = ("inflight", "buffered", "trained", "dropped_stale", "filtered", "errored", "cancelled")


@pytest.mark.timeout(300)
def test_reward_faults_and_overlong_are_counted_and_the_run_goes_on(tiny_model_dir: Path, tmp_path: Path):
    torch.set_num_threads(1)
    steps, seq_len = 4, 72  # the reverse-text prompt is ~50 tokens: long completions hit seq_len
    cfg = OrchestratorConfig.model_validate({
        "output_dir": str(tmp_path), "max_steps": steps, "seq_len": seq_len,
        "batch_groups": 2, "group_size": 2,
        "max_off_policy_steps": steps, "admission": {"unused_handler": "retry"}, "wandb": {"enabled": False},
        "sampling": {"temperature": 1.0, "max_tokens": 40},
        "envs": [{"id": "reverse-text", "args": {
            "num_examples": 64, "task": {"rewards": {"lcs": {"fn": f"{FLAKY}:flaky_reward"}}}}}],
    })  # fmt: skip
    engine = HFEngineClient(model_dir=str(tiny_model_dir), version=0)
    trained: dict[int, list] = {}
    metrics: dict[int, dict[str, float]] = {}

    async def main() -> None:
        async with build_rollout_source(
            env_cfg=cfg.envs[0], engines=[engine], model_path=str(tiny_model_dir), seq_len=seq_len
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

            async def send(batch) -> None:
                pass  # no trainer: the batch was built (packing/advantages ran); nothing consumes it

            def log(m: dict[str, float], step: int) -> None:
                metrics[step] = {**m, **source.metrics()}

            await run_loop(cfg, comps, send_batch=send, log_metrics=log,
                           on_step=lambda s, g: trained.__setitem__(s, g))  # fmt: skip

    asyncio.run(asyncio.wait_for(main(), timeout=240))
    assert sorted(trained) == list(range(steps))
    last = metrics[steps - 1]
    for m in metrics.values():
        assert m["ledger/dispatched"] == sum(m[f"ledger/{b}"] for b in BUCKETS)
    assert last["env/errors/reward"] >= 2, last  # raise + NaN/None each became an "error" under "reward"
    assert last["ledger/errored"] >= last["env/errors/reward"]  # each faulty episode (+ its group-mates)
    for groups in trained.values():
        for g in groups:
            for ep in g.episodes:
                assert ep.status == "ok" and ep.reward is not None and math.isfinite(ep.reward)
    truncated = sum(ep.truncated for gs in trained.values() for g in gs for ep in g.episodes)
    lengths = [len(ep.token_ids) for gs in trained.values() for g in gs for ep in g.episodes]
    assert max(lengths) <= seq_len
    print(f"env/errors: { {k: v for k, v in last.items() if k.startswith('env/errors/')} }, "
          f"errored episodes {last['ledger/errored']:.0f}, truncated trained {truncated}")  # fmt: skip
