"""Images of one model call: where they sit in the prompt's token sequence (`ImagePlacer`).

verifiers' train client sends a prompt with images as vLLM's token-in request with
`process_multimodal=False`: `token_ids` hold one `<|image_pad|>` per image (the renderer's unexpanded
prompt) and `content_parts` the images, in prompt order, as `{"type": "image_url", "url": ...}`. The
gateway (`rollouts/gateway.py`) asks `ImagePlacer.place` for the expanded prompt: each image's one pad
token becomes `t * h * w / merge**2` pad tokens, the count the model's own image processor gives for that
image (its `image_grid_thw`), as the engine expands it (SGLang's and the embedded engine's `image_data`).
The answer carries the expanded prompt (`prompt_token_ids`) and each image's placeholder range
(`mm_placeholders`), which verifiers projects onto its trace; the call records `PromptImages`.

Invariants:
- `place` is pure given the model directory: the same ids and images give the same expansion;
- `PromptImages.spans[i]` is image i's `(offset, length)` in the expanded ids, in prompt order, every
  token in it the image token id, and `length = prod(grid_thw[i]) // merge**2`;
- a prompt whose pad tokens and images differ in number, one with a video placeholder token, an image
  that does not decode, or one that is not a data URL or a local file (nothing downloads at run time)
  raises `ImageError`, one line naming the image by its place in the prompt (1-based) where one is at
  fault. A placeholder token the policy sampled in an earlier reply counts as one (verifiers aligns the
  prompt by them), so such an episode ends in an error naming it, and the run goes on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ImageError(ValueError):
    """An image of a prompt that cannot be used (the message names which one and why)."""


@dataclass(frozen=True)
class PromptImages:
    """The images of one call's prompt, in prompt order: their sources (data URLs or paths, as the env
    gave them), placeholder ranges in the expanded prompt, and the processor's `(t, h, w)` grids."""

    urls: list[str] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    grid_thw: list[tuple[int, int, int]] = field(default_factory=list)

    def placeholders(self) -> dict[str, list[dict[str, int]]]:
        """vLLM's `mm_placeholders` answer field."""
        return {"image": [{"offset": o, "length": n} for o, n in self.spans]}


def image_urls(content_parts: Any) -> list[str]:
    """The image URLs of a request's `content_parts` (other kinds refused: only images are supported)."""
    if not isinstance(content_parts, list):
        raise ImageError("content_parts must be a list of {type, url} parts")
    urls = []
    for i, part in enumerate(content_parts, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "image_url":
            raise ImageError(f"content part {i} is {kind!r}: only images (image_url) are supported")
        url = part.get("url")
        if not isinstance(url, str) or not url:
            raise ImageError(f"image {i} of the prompt has no url")
        urls.append(url)
    return urls


def image_bytes(url: str) -> bytes:
    """The encoded image file of a data URL or a local path (what the trainer decodes)."""
    if url.startswith("data:"):
        return base64.b64decode(url.partition(",")[2])
    return Path(url.removeprefix("file://")).read_bytes()


def load_image(url: str, index: int) -> Any:
    """The PIL image (RGB) of a data URL or a local path; `ImageError` naming image `index` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith(("http://", "https://")):
        raise ImageError(f"image {index} of the prompt is a remote URL: nothing downloads at run time")
    try:
        if url.startswith("data:"):
            data = base64.b64decode(url.partition(",")[2], validate=True)
            image = Image.open(io.BytesIO(data))
        else:
            image = Image.open(Path(url.removeprefix("file://")))
        image.load()
    except (binascii.Error, OSError, UnidentifiedImageError, ValueError) as e:
        raise ImageError(f"image {index} of the prompt does not decode: {type(e).__name__}: {e}") from e
    return image.convert("RGB")


def image_placer(model_path: str) -> ImagePlacer | None:
    """The placer of a local vision-language model (config.json names an `image_token_id`), else None."""
    config = Path(model_path) / "config.json"
    if not config.is_file() or "image_token_id" not in json.loads(config.read_text()):
        return None
    return ImagePlacer(model_path)


class ImagePlacer:
    """Expands a prompt's image pad tokens with the model's image processor (module docstring)."""

    def __init__(self, model_path: str) -> None:
        config = json.loads((Path(model_path) / "config.json").read_text())
        if "image_token_id" not in config:
            raise ValueError(f"model {model_path!r} has no image_token_id in config.json: not a VLM")
        self.image_token_id = int(config["image_token_id"])
        self.video_token_id = config.get("video_token_id")  # videos are not supported: refused
        self.merge = int(config.get("vision_config", {}).get("spatial_merge_size", 2))
        self.model_path = model_path
        self._processor: Any = None
        self._grids: dict[str, tuple[int, int, int]] = {}  # image digest -> grid (an image recurs per turn)

    def grid(self, url: str, index: int) -> tuple[int, int, int]:
        """The processor's `(t, h, w)` patch grid of one image (cached by content)."""
        key = hashlib.blake2b(url.encode(), digest_size=16).hexdigest()
        if key not in self._grids:
            if self._processor is None:
                from transformers import AutoImageProcessor

                self._processor = AutoImageProcessor.from_pretrained(self.model_path)
            out = self._processor(images=[load_image(url, index)], return_tensors="np")
            t, h, w = (int(x) for x in out["image_grid_thw"][0])
            self._grids[key] = (t, h, w)
        return self._grids[key]

    def place(self, token_ids: list[int], urls: list[str]) -> tuple[list[int], PromptImages]:
        """(expanded ids, the images' placement); `ImageError` when pads and images do not match."""
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise ImageError(
                "the prompt holds a video placeholder token (videos are not supported; a reply the model "
                "sampled it in counts too)"
            )
        pads = sum(1 for t in token_ids if t == self.image_token_id)
        if pads != len(urls):
            raise ImageError(
                f"the prompt has {pads} image placeholder tokens but {len(urls)} images (an image pad token "
                "the model sampled in an earlier reply counts too)"
            )
        grids = [self.grid(url, i) for i, url in enumerate(urls, start=1)]
        expanded: list[int] = []
        spans: list[tuple[int, int]] = []
        for tok in token_ids:
            if tok != self.image_token_id:
                expanded.append(tok)
                continue
            t, h, w = grids[len(spans)]
            n = t * h * w // self.merge**2
            spans.append((len(expanded), n))
            expanded.extend([tok] * n)
        return expanded, PromptImages(urls=list(urls), spans=spans, grid_thw=grids)


@dataclass(frozen=True)
class ImagePrompt:
    """A call's prompt with images: the ids the engine receives with `image_data` (unexpanded: one pad
    token per image, as the renderer gave them) and the images' placement in the expanded ids."""

    engine_ids: list[int]
    images: PromptImages

    def extended(self, output_ids: list[int]) -> ImagePrompt:
        """The same images after `output_ids` were appended (a recorded partial call continued)."""
        return ImagePrompt(engine_ids=[*self.engine_ids, *output_ids], images=self.images)
