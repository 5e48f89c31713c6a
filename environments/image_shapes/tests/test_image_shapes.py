"""image-shapes: the images, the reward and the messages without a model.

Run: `uv run pytest -n 0 environments/image_shapes/tests`. Real episodes on the tiny VLM run in
`tests/rollouts/test_vlm_episodes.py` and the `rl @ configs/tiny/rl_vlm.toml` test.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random

import verifiers.v1 as vf
from image_shapes import (
    COLOURS,
    ImageShapesData,
    ImageShapesTask,
    ImageShapesTaskset,
    ImageShapesTasksetConfig,
    answer_score,
    draw_shapes,
)
from PIL import Image


def _decode(url: str) -> Image.Image:
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_images_are_drawn_in_their_colour() -> None:
    image = draw_shapes("blue", 2, 56, random.Random(0))
    assert image.size == (56, 56) and image.mode == "RGB"
    assert COLOURS["blue"] in {c for _, c in image.getcolors(56 * 56)}


def test_taskset_is_seeded_and_carries_one_image_per_turn() -> None:
    def load(seed: int) -> list[ImageShapesData]:
        cfg = ImageShapesTasksetConfig(num_examples=4, seed=seed, turns=3)
        return [t.data for t in ImageShapesTaskset(cfg).load()]

    first, again = load(0), load(0)
    assert [d.images for d in first] == [d.images for d in again]
    assert [d.images for d in first] != [d.images for d in load(1)]
    data = first[0]
    assert len(data.colours) == len(data.images) == 3
    assert _decode(data.images[1]).size == (56, 56)
    parts = data.prompt[0].content  # the first image is in the prompt, before the question
    assert parts[0].type == "image_url" and parts[0].image_url.url == data.images[0]
    assert parts[1].type == "text"


def test_reward_scores_each_reply_against_its_image() -> None:
    assert answer_score("Red.", "red") == 1.0 and answer_score("", "red") == 0.0
    assert answer_score("x1", "red") == 0.25  # partial credit: half the letter fraction
    data = ImageShapesData(id="t", prompt="?", colours=["red", "blue"], images=["a", "b"])
    task = ImageShapesTask(data)

    class Replies:
        def __init__(self, *replies: str) -> None:
            self.assistant_messages = [vf.AssistantMessage(content=r) for r in replies]

    assert asyncio.run(task.colour(data, Replies("red", "blue"))) == 1.0
    assert asyncio.run(task.colour(data, Replies("red", "green"))) == 0.75
    assert asyncio.run(task.correct(data, Replies("red", "green"))) == 0.5
    assert asyncio.run(task.images(data, Replies("red"))) == 1.0


def test_broken_every_corrupts_the_last_image_of_every_nth_task() -> None:
    from image_shapes.env import BROKEN_IMAGE

    tasks = ImageShapesTaskset(ImageShapesTasksetConfig(num_examples=6, broken_every=3)).load()
    assert [t.data.images[-1] == BROKEN_IMAGE for t in tasks] == [False, False, True] * 2
    assert all(t.data.images[0] != BROKEN_IMAGE for t in tasks)
