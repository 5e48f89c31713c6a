"""image-shapes: name the colour of the shapes in an image, over several turns (verifiers v1 multi-turn
environment with images, generated offline with PIL).

Loaded by id (`image-shapes` or `image_shapes`): verifiers imports this package and takes the one `vf.Taskset`
subclass and the one `vf.Env` subclass exported in `__all__`.
"""

from __future__ import annotations

from image_shapes.env import (
    COLOURS,
    ImageShapesData,
    ImageShapesEnv,
    ImageShapesTask,
    ImageShapesTaskset,
    ImageShapesTasksetConfig,
    answer_score,
    draw_shapes,
    first_word,
    image_message,
)

__all__ = [
    "COLOURS",
    "ImageShapesData",
    "ImageShapesEnv",
    "ImageShapesTask",
    "ImageShapesTaskset",
    "ImageShapesTasksetConfig",
    "answer_score",
    "draw_shapes",
    "first_word",
    "image_message",
]
