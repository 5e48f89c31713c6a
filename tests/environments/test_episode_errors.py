"""Episode errors are visible: the real orchestrator components (`build_components` + `run_loop`) over a
real verifiers env whose reward always raises (tiny model, in-process HF engine).

Regression of issue 11: such a run used to die after `max_dropped_groups_per_step` drops with only
"... last reason: errored". Now it stops after the first 2 groups with one error naming the cause, and
the error is logged once at WARNING.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from hf_engine import HFEngineClient

from prime_async.config.orchestrator import OrchestratorConfig
from prime_async.orchestrator.components import ComponentInputs, build_components
from prime_async.orchestrator.orchestrator import run_loop
from prime_async.rollouts.episode_errors import EpisodesFailing
from prime_async.rollouts.verifiers_source import build_rollout_source
from prime_async.simulation import InMemoryBroadcasts
from prime_async.weights.loaders.filesystem import FilesystemLoader

pytest.importorskip("verifiers.v1")
FAULTY = Path(__file__).parent / "faulty_rewards.py"


def config(tmp_path: Path, **over: object) -> OrchestratorConfig:
    rewards = {"lcs": {"fn": f"{FAULTY}:raising_reward"}}
    return OrchestratorConfig.model_validate({
        "output_dir": str(tmp_path), "max_steps": 3, "seq_len": 256, "batch_groups": 2, "group_size": 2,
        "wandb": {"enabled": False}, "sampling": {"temperature": 1.0, "max_tokens": 6},
        "envs": [{"id": "reverse-text", "args": {"num_examples": 16, "task": {"rewards": rewards}}}],
        **over,
    })  # fmt: skip


def run(cfg: OrchestratorConfig, model_dir: Path) -> list[int]:
    engine = HFEngineClient(model_dir=str(model_dir), version=0)
    steps: list[int] = []

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

            async def send(batch) -> None:
                pass

            await run_loop(cfg, comps, send_batch=send, log_metrics=lambda m, s: steps.append(s))

    asyncio.run(asyncio.wait_for(main(), timeout=200))
    return steps


@pytest.mark.timeout(300)
def test_every_early_episode_failing_stops_the_run_naming_the_cause(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with pytest.raises(EpisodesFailing) as info:
        run(config(tmp_path), tiny_model_dir)
    message = str(info.value)
    assert "every episode of the first 2 groups failed" in message and "\n" not in message
    assert "[reward]" in message and "RuntimeError: reward exploded" in message
    assert "faulty_rewards.py:7 in raising_reward]" in message, "the user's file and line, not verifiers'"
    logged = [r for r in caplog.records if r.levelname == "WARNING" and "episode error [reward]" in r.message]
    assert len(logged) == 1, "one distinct error is logged once"


@pytest.mark.timeout(300)
def test_dropped_groups_limit_names_the_most_frequent_episode_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = config(tmp_path, admission={"fail_fast_groups": 0, "max_dropped_groups_per_step": 3})
    with pytest.raises(RuntimeError, match="max_dropped_groups_per_step = 3") as info:
        run(cfg, tiny_model_dir)
    assert "most frequent episode error" in str(info.value) and "reward exploded" in str(info.value)


def test_user_frame_is_the_innermost_user_frame_of_the_root_cause(tmp_path: Path) -> None:
    """A chained traceback as verifiers records it: the user's reward raised, verifiers re-raised it as a
    TaskError. The location is the reward's line, not verifiers' and not the env's outer frame."""
    import verifiers

    from prime_async.rollouts.episode_errors import user_frame

    site = Path(verifiers.__file__).parent / "v1"
    user = tmp_path / "my_env" / "rewards.py"
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{site}/task.py", line 264, in score\n    x\n'
        f'  File "{user.parent}/env.py", line 20, in helper\n    y\n'
        f'  File "{user}", line 7, in my_reward\n    raise RuntimeError("x")\n'
        f'  File "{Path(asyncio.__file__).parent}/tasks.py", line 10, in gather\n    z\n'
        "RuntimeError: x\n\nThe above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n"
        f'  File "{user.parent}/env.py", line 40, in run\n    w\n'
        f'  File "{site}/errors.py", line 95, in boundary\n    raise\n'
        "verifiers.v1.errors.TaskError: scoring: RuntimeError: x\n"
    )
    assert user_frame(text) == f"{user}:7 in my_reward"
    assert user_frame(text.replace(str(user), f"{site}/x.py").replace(str(user.parent), str(site))) is None
    assert user_frame(None) is None and user_frame("RuntimeError: x") is None
