"""Images of a `/generate` request (SGLang's `image_data`): decoded, preprocessed by the model's own image
processor, and their placeholder tokens expanded, before the request reaches the engine.

Runs in the server (`inference/server.py`), off the event loop; the engine and the runner only see an
`ImagePrompt`.

Invariants:
- An item of `image_data` is a data URL (`data:image/png;base64,...`), bare base64, or the path of a local
  file; http(s) URLs are refused (nothing is downloaded at run time). Anything that does not decode into
  an image is a `ValueError` naming the item (`image_data[i][j]`), which the server answers with HTTP 400.
- Image k of a prompt belongs to the k-th run of `<|image_pad|>` tokens of its `input_ids`. A run of one
  token is expanded to the image's token count `t * h * w / merge**2` (`image_grid_thw`), as the HF
  processor does for a rendered chat template; a run of exactly that count is taken as already expanded;
  any other length, or a run count different from the image count, is refused.
- `ImagePrompt.ids` is the expanded prompt: the token ids the model runs and the response's
  `prompt_tokens` counts; `runs[k]` is image k's [start, end) in it.
- `keys[k]` is a digest of image k's pixel values and grid: equal keys mean equal vision-tower inputs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ImagePrompt:
    """One prompt's images, ready for the vision tower (pixel values on the CPU, float32)."""

    ids: list[int]  # the expanded prompt
    pixel_values: torch.Tensor  # (sum of t*h*w over the images, channels * temporal * patch**2)
    grids: list[tuple[int, int, int]]  # image_grid_thw of each image, in patches
    runs: list[tuple[int, int]]  # [start, end) of each image's placeholder tokens in `ids`
    keys: list[str]  # digest of each image's pixel values and grid

    def patches(self, k: int) -> torch.Tensor:
        """Pixel values of image k (its t*h*w patch rows)."""
        sizes = [t * h * w for t, h, w in self.grids]
        start = sum(sizes[:k])
        return self.pixel_values[start : start + sizes[k]]


def decode_image(item: str, where: str):
    """`item` (data URL, base64, or a local path) -> an RGB PIL image; ValueError naming `where`."""
    from PIL import Image

    if item.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: image URLs are not fetched (nothing downloads at run time); send a data URL"
        )
    if item.startswith("data:"):
        header, _, payload = item.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"{where}: a data URL must be base64-encoded (got {header[:40]!r})")
        raw = _b64(payload, where)
    elif len(item) < 4096 and Path(item).is_file():
        raw = Path(item).read_bytes()
    else:
        raw = _b64(item, where)
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except Exception as exc:  # PIL raises several types for truncated or unknown data
        raise ValueError(f"{where}: not a decodable image ({type(exc).__name__}: {exc})") from exc
    return image.convert("RGB")


def _b64(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: neither a data URL, a local file nor valid base64 ({exc})") from exc


class ImageInputs:
    """The model's image processor and placeholder token: turns (input_ids, image_data) into an
    `ImagePrompt`. Built for models with a vision tower only (`for_model`)."""

    def __init__(self, model_path: str, *, image_token_id: int, merge_size: int) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.pad_id = image_token_id
        self.merge = merge_size

    @classmethod
    def for_model(cls, model_path: str, config) -> ImageInputs | None:
        """None when `config` (an HF config) has no vision tower."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        return cls(
            model_path, image_token_id=int(config.image_token_id), merge_size=int(vision.spatial_merge_size)
        )

    def prepare(self, prompt: list[int], items: list[str], where: str) -> ImagePrompt | None:
        """Decode and preprocess `items`, expand `prompt`'s placeholders; ValueError naming the problem.
        None for a prompt without images (refused if it holds placeholder tokens)."""
        if not items:
            expand_placeholders(prompt, self.pad_id, [], where)
            return None
        images = [decode_image(item, f"{where}[{k}]") for k, item in enumerate(items)]
        try:
            out = self.processor(images=images, return_tensors="pt")
        except Exception as exc:  # e.g. an image too small or too elongated for the resize
            raise ValueError(f"{where}: the image processor refused the images ({exc})") from exc
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        pixel_values = out["pixel_values"].float()
        ids, runs = expand_placeholders(prompt, self.pad_id, [self.tokens(g) for g in grids], where)
        sizes = [t * h * w for t, h, w in grids]
        parts = pixel_values.split(sizes)
        keys = [_digest(p, g) for p, g in zip(parts, grids, strict=True)]
        return ImagePrompt(ids=ids, pixel_values=pixel_values, grids=grids, runs=runs, keys=keys)  # type: ignore[arg-type]

    def tokens(self, grid: tuple[int, ...]) -> int:
        """Placeholder tokens of an image with `image_grid_thw` = grid."""
        t, h, w = grid
        return t * h * w // self.merge**2


def _digest(pixels: torch.Tensor, grid: tuple[int, ...]) -> str:
    h = hashlib.sha256(repr(grid).encode())
    h.update(pixels.contiguous().numpy().tobytes())
    return h.hexdigest()


def placeholder_runs(prompt: list[int], pad_id: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of `pad_id` in `prompt`."""
    runs: list[tuple[int, int]] = []
    for i, tok in enumerate(prompt):
        if tok != pad_id:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def expand_placeholders(
    prompt: list[int], pad_id: int, counts: list[int], where: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """`prompt` with image k's run of `pad_id` grown to `counts[k]` tokens (a run of 1), or kept (a run of
    exactly `counts[k]`); -> (expanded ids, each image's [start, end) in them)."""
    runs = placeholder_runs(prompt, pad_id)
    if len(runs) != len(counts):
        raise ValueError(
            f"{where}: {len(counts)} images for {len(runs)} runs of the image placeholder token {pad_id} "
            "in input_ids"
        )
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    last = 0
    for k, ((start, end), n) in enumerate(zip(runs, counts, strict=True)):
        if end - start not in (1, n):
            raise ValueError(
                f"{where}[{k}]: its placeholder run has {end - start} tokens; the image needs {n} "
                "(send one placeholder token per image, or exactly the image's count)"
            )
        ids.extend(prompt[last:start])
        spans.append((len(ids), len(ids) + n))
        ids.extend([pad_id] * n)
        last = end
    ids.extend(prompt[last:])
    return ids, spans
