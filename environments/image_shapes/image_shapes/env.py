"""image-shapes: name the colour of the shapes in an image, over several turns (a multi-turn image task).

Turn 1: the user shows an image (shapes of one colour drawn with PIL on a white background) and asks for
the colour; each later turn the env shows a new image of another colour in a new user message and asks
again, for `turns` model turns in all. Images travel as verifiers v1 content parts
(`vf.ImageUrlContentPart` with a base64 PNG data URL), so the renderer places them in the prompt and the
engine receives them (`image_data`).

Reward `colour`: the mean over the model's replies of `answer_score` (1.0 when the reply's first word is
the right colour; else half the fraction of letters among the first word, so even a random policy gets a
signal a tiny model can move). Metrics: `correct` (the fraction of replies naming the right colour) and
`images` (images shown in the episode).

Invariants: the same `seed` gives the same images in the same order (no download, no global RNG); the
reward is in [0, 1]; the env never makes more than `turns` model turns; every image is `size` x `size`.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterable

import verifiers.v1 as vf
from PIL import Image, ImageDraw
from pydantic import Field
from verifiers.v1.types import content_text
from verifiers.v1.utils.image import image_data_url

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 20),
    "black": (10, 10, 10),
}
SHAPES = ("circle", "square")
SYSTEM_PROMPT = "You see images of shapes. Answer with the colour of the shapes: one word."
QUESTION = "What colour are the shapes? One word."
BROKEN_IMAGE = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
"""A data URL whose bytes are no image (`broken_every`)."""


def draw_shapes(colour: str, count: int, size: int, rng: random.Random) -> Image.Image:
    """`count` shapes (circles or squares) of `colour` at seeded places on a white `size` x `size` RGB
    image."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    side = max(size // 4, 4)
    for _ in range(count):
        x, y = rng.randrange(0, size - side), rng.randrange(0, size - side)
        box = (x, y, x + side, y + side)
        if rng.choice(SHAPES) == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        else:
            draw.rectangle(box, fill=COLOURS[colour])
    return image


def first_word(text: str) -> str:
    """The reply's first whitespace token, lowercased, stripped of surrounding punctuation."""
    tokens = text.strip().split()
    return tokens[0].strip(".,;:!?\"'()[]").lower() if tokens else ""


def answer_score(reply: str, colour: str) -> float:
    """1.0 when the reply's first word is `colour`; else half the fraction of letters among it."""
    word = first_word(reply)
    if word == colour:
        return 1.0
    return 0.5 * sum(c.isalpha() for c in word) / len(word) if word else 0.0


def image_message(url: str, text: str) -> vf.UserMessage:
    """A user message of one image (`url`: a PNG data URL) followed by the question `text`."""
    return vf.UserMessage(
        content=[vf.ImageUrlContentPart(image_url=vf.ImageUrlSource(url=url)), vf.TextContentPart(text=text)]
    )


class ImageShapesData(vf.TaskData):
    """One task: the colours of its images, one per turn (`colours[0]` in the prompt)."""

    colours: list[str]
    """The colour of each turn's image."""
    images: list[str]
    """Each turn's image as a PNG data URL (`images[0]` is in the prompt)."""


class ImageShapesTask(vf.Task[ImageShapesData]):
    """Scores one episode's trace: the model's k-th reply answers the k-th image."""

    @vf.reward
    async def colour(self, task: ImageShapesData, trace: vf.Trace) -> float:
        """Mean `answer_score` of the replies against their images' colours."""
        replies = [content_text(m.content) for m in trace.assistant_messages]
        scores = [answer_score(r, c) for r, c in zip(replies, task.colours, strict=False)]
        return sum(scores) / len(scores) if scores else 0.0

    @vf.metric
    async def correct(self, task: ImageShapesData, trace: vf.Trace) -> float:
        """The fraction of replies whose first word is the right colour."""
        replies = [content_text(m.content) for m in trace.assistant_messages]
        hits = [first_word(r) == c for r, c in zip(replies, task.colours, strict=False)]
        return sum(hits) / len(hits) if hits else 0.0

    @vf.metric
    async def images(self, task: ImageShapesData, trace: vf.Trace) -> float:
        """Images shown: one per model turn taken."""
        return float(min(len(trace.assistant_messages), len(task.images)))


class ImageShapesTasksetConfig(vf.TasksetConfig):
    """The taskset's args (`[orchestrator.env] args = { ... }`)."""

    num_examples: int = Field(1000, ge=1)
    """How many tasks `load()` yields."""
    seed: int = 0
    """Seed of the colours, counts and places."""
    turns: int = Field(2, ge=1, le=8)
    """Model turns per episode, one image each: every turn's prompt holds the earlier images."""
    size: int = Field(56, ge=28, le=448)
    """Image side in pixels (56: 4 image tokens each on a Qwen2.5-VL processor, patch 14, merge 2)."""
    max_shapes: int = Field(3, ge=1, le=8)
    """Shapes per image: 1 to this."""
    broken_every: int = Field(0, ge=0)
    """> 0: every `broken_every`-th task's last image is not a decodable PNG (`BROKEN_IMAGE`): shows a
    corrupt image failing its episode (an error naming the example) while the run goes on. 0: none."""


def make_task(index: int, cfg: ImageShapesTasksetConfig, rng: random.Random) -> ImageShapesTask:
    """Task `index`: `cfg.turns` images of random colours, the first in the prompt."""
    colours = [rng.choice(sorted(COLOURS)) for _ in range(cfg.turns)]
    images = [image_data_url(draw_shapes(c, rng.randint(1, cfg.max_shapes), cfg.size, rng)) for c in colours]
    if cfg.broken_every and index % cfg.broken_every == cfg.broken_every - 1:
        images[-1] = BROKEN_IMAGE
    data = ImageShapesData(
        id=f"image_shapes-{index}",
        prompt=[image_message(images[0], QUESTION)],
        system_prompt=SYSTEM_PROMPT,
        colours=colours,
        images=images,
    )
    return ImageShapesTask(data, cfg.task)


class ImageShapesTaskset(vf.Taskset[ImageShapesTask, ImageShapesTasksetConfig]):
    def load(self) -> Iterable[ImageShapesTask]:
        rng = random.Random(self.config.seed)
        return [make_task(i, self.config, rng) for i in range(self.config.num_examples)]


class ImageShapesEnv(vf.Env[vf.SingleAgentEnvConfig]):
    """One seat (`agent`); each later turn the env shows the next image and asks again."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        data = task.data
        async with agents.agent.interaction(task) as player:
            segment = await player.turn()  # the model answers the first image
            for url in data.images[1:]:
                if segment.terminated:
                    break
                segment = await player.turn([image_message(url, f"And now? {QUESTION}")])
