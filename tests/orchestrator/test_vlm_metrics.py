"""The orchestrator's VLM metrics (issue 40): `rollout/images_per_episode` from the trained episodes'
images, `inference/vision_s` from the engines' `/get_server_info` `vision_s` counters."""

from __future__ import annotations

import asyncio
from typing import Any

from prime_async.orchestrator.engine_load import EngineLoad
from prime_async.orchestrator.metrics import batch_metrics
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import Episode, EpisodeImage, PolicySpan


def _episode(images: int) -> Episode:
    ids = [1] * (4 * images) + [2, 3]
    return Episode(
        example_id=0, token_ids=ids, loss_mask=[False] * (len(ids) - 1) + [True],
        sampler_logprobs=[0.0] * len(ids), token_versions=[-1] * (len(ids) - 1) + [0], reward=1.0,
        span=PolicySpan(0, 0),
        images=[EpisodeImage("data:image/png;base64,AA==", 4 * i, 4, (1, 4, 4), i) for i in range(images)],
    )  # fmt: skip


def test_images_per_episode_is_the_mean_over_trained_episodes() -> None:
    groups = [
        Group(group_id=0, example_id=0, dispatch_version=0, episodes=[_episode(2), _episode(1)]),
        Group(group_id=1, example_id=1, dispatch_version=0, episodes=[_episode(0), _episode(1)]),
    ]
    assert batch_metrics(groups, step=0)["rollout/images_per_episode"] == 1.0


def test_text_batches_log_no_image_metric() -> None:
    groups = [Group(group_id=0, example_id=0, dispatch_version=0, episodes=[_episode(0), _episode(0)])]
    assert "rollout/images_per_episode" not in batch_metrics(groups, step=0)


class _Engine:
    """An engine answering `/get_server_info` with the next of `infos` (a dict, or an exception)."""

    def __init__(self, url: str, infos: list[Any]):
        self.base_url, self.infos = url, infos

    async def server_info(self) -> dict[str, Any]:
        info = self.infos.pop(0)
        if isinstance(info, BaseException):
            raise info
        return info


def _info(vision_s: float, uptime_s: float) -> dict[str, float]:
    return {"busy_s": uptime_s / 2, "uptime_s": uptime_s, "vision_s": vision_s}


def test_vision_s_sums_the_engines_tower_seconds_since_the_previous_step() -> None:
    a = _Engine("a", [_info(1.0, 10.0), _info(1.5, 12.0), _info(0.25, 1.0), _info(0.5, 2.0)])
    b = _Engine("b", [_info(0.0, 10.0), _info(0.25, 12.0), _info(0.5, 14.0), _info(0.5, 16.0)])
    text = _Engine("c", [{"busy_s": 1.0, "uptime_s": 2.0}] * 4)
    load = EngineLoad([a, b, text])  # type: ignore[list-item]
    steps = [asyncio.run(load.metrics()) for _ in range(4)]
    assert "inference/vision_s" not in steps[0]  # the first answer is the baseline
    assert steps[1]["inference/vision_s"] == 0.75
    assert steps[2]["inference/vision_s"] == 0.25  # a restarted (counters went back): b only
    assert steps[3]["inference/vision_s"] == 0.25  # a counts again from its restart
    assert steps[3]["engine/busy_fraction"] > 0


def test_text_engines_log_no_vision_metric() -> None:
    load = EngineLoad([_Engine("c", [{"busy_s": 1.0, "uptime_s": 2.0}, {"busy_s": 2.0, "uptime_s": 4.0}])])  # type: ignore[list-item]
    asyncio.run(load.metrics())
    assert asyncio.run(load.metrics()) == {"engine/busy_fraction": 0.5}
