"""Vision inputs of packed rows for a vision-language model (the fsdp backend): pixel values, image grids
and multimodal rotary positions (M-RoPE) per row, and the vision tower's trained/frozen switch.

A row's images (`MicroBatch.images`, in token order) are decoded and run through the model's own image
processor, so the trainer's pixel values are the engine's for the same encoded image. Positions: HF's
Qwen2.5-VL takes (4, 1, T) `position_ids`, row 0 the packed text positions (HF builds the block-diagonal
mask from them), rows 1-3 the M-RoPE (t, h, w) positions; each packed sample's M-RoPE positions are its
own sequence's (`get_rope_index` on its tokens and images), and a branch's are the tail of its full
sequence (its block's first sample's first S tokens and their images, then its own).

Invariants:
- `RowVision.inputs` is None for a row without images (the model's text positions are then exact);
- with images: `pixel_values` holds every image of the row in row order, `image_grid_thw` one row per
  image, and each image's span holds `t * h * w / merge**2` image tokens (checked: one line otherwise);
  image features go to the spans only (`placing`): an image-pad token the policy sampled is text, as in
  the engine;
- `freeze_vision_tower` sets `requires_grad = False` on the vision tower's parameters only.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from prime_async.trainer.packed_rows import sample_starts
from prime_async.transport.types import MicroBatch, RowImage


def checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2.5-VL's tensors under the hub checkpoint's names, what `save_pretrained` writes and SGLang's
    loader reads: `model.language_model.*` -> `model.*`, `model.visual.*` -> `visual.*`, `lm_head.*` kept.
    The published weights use them, so every engine and `from_pretrained` load a broadcast as a
    checkpoint (the embedded engine takes either layout: `inference/vision.py: model_names`)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("model.visual."):
            name = name[len("model.") :]
        elif name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        out[name] = tensor
    return out


def is_vision_language(model_path: str) -> bool:
    """Whether the local checkpoint is a vision-language model (its config.json has a vision_config)."""
    config = Path(model_path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower (with its merger/projector) of an HF VLM (`model.model.visual`)."""
    inner = model.get_submodule("model")
    return inner.get_submodule("visual")


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop training the vision tower; the number of parameters frozen."""
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


class RowVision:
    """Builds a row's vision inputs (module docstring). Built from the unwrapped model, before FSDP."""

    def __init__(self, model: torch.nn.Module, model_path: str) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id = int(model.config.image_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)
        self._inner = model.get_submodule("model")
        self._rope_index = self._inner.get_rope_index

    def pixels(self, images: list[RowImage]) -> torch.Tensor:
        """The processor's pixel values of `images`, concatenated in order; grids checked against theirs."""
        from PIL import Image

        decoded = [Image.open(io.BytesIO(im.data)).convert("RGB") for im in images]
        out = self.processor(images=decoded, return_tensors="pt")
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        if grids != [im.grid_thw for im in images]:
            raise ValueError(f"image grids {grids} differ from the engine's {[im.grid_thw for im in images]}")
        return out["pixel_values"]

    def inputs(self, mb: MicroBatch, device: torch.device) -> dict[str, torch.Tensor] | None:
        """`pixel_values`, `image_grid_thw` and (4, 1, T) `position_ids` of a row with images, else None."""
        if not mb.images:
            return None
        ids = torch.from_numpy(np.asarray(mb.input_ids, dtype=np.int64))
        for im in mb.images:
            span = ids[im.offset : im.offset + im.length]
            t, h, w = im.grid_thw
            if im.length != t * h * w // self.merge**2 or bool((span != self.image_token_id).any()):
                raise ValueError(
                    f"row image at token {im.offset}: its {im.length} tokens do not hold grid {im.grid_thw}"
                )
        text = torch.from_numpy(np.asarray(mb.position_ids, dtype=np.int64))
        mrope = self.row_positions(ids, text, mb.images)
        return {
            "pixel_values": self.pixels(mb.images).to(device),
            "image_grid_thw": torch.tensor(
                [im.grid_thw for im in mb.images], dtype=torch.long, device=device
            ),
            "position_ids": torch.cat([text[None], mrope]).to(device)[:, None, :],
        }

    def row_positions(self, ids: torch.Tensor, text: torch.Tensor, images: list[RowImage]) -> torch.Tensor:
        """(3, T) M-RoPE positions of a packed row: each sample's (a branch's over its full sequence)."""
        starts = np.flatnonzero(sample_starts(text.numpy())).tolist()
        ends = [*starts[1:], int(ids.shape[0])]
        out = torch.empty(3, ids.shape[0], dtype=torch.long)
        block = 0  # start of the current block's first sample
        for start, end in zip(starts, ends, strict=True):
            shared = int(text[start])
            if shared == 0:
                block = start
            seq = torch.cat([ids[block : block + shared], ids[start:end]])
            kinds = torch.zeros(seq.shape[0], dtype=torch.int)  # 1 on the images' spans only
            inside = []
            for im in images:
                if block <= im.offset < block + shared or start <= im.offset < end:
                    at = im.offset - block if im.offset < block + shared else shared + im.offset - start
                    kinds[at : at + im.length] = 1
                    inside.append(im.grid_thw)
            out[:, start:end] = self._sample_positions(seq, kinds, inside)[:, shared:]
        return out

    def _sample_positions(
        self, seq: torch.Tensor, kinds: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """(3, L) M-RoPE positions of one full sample sequence (`kinds`: 1 on its images' tokens)."""
        if not grids:
            return torch.arange(seq.shape[0]).expand(3, -1)
        pos, _ = self._rope_index(
            seq[None], mm_token_type_ids=kinds[None], image_grid_thw=torch.tensor(grids, dtype=torch.long)
        )
        return pos[:, 0]

    @contextlib.contextmanager
    def placing(self, mb: MicroBatch, device: torch.device) -> Iterator[None]:
        """While open, the model puts image features on the row's image spans only (`mb.images`): a
        sampled image-pad token elsewhere (a random policy may sample one) stays a text token, as the
        engine decoded it. Overrides the model's `get_placeholder_mask` on this instance."""
        mask = torch.zeros(mb.num_tokens, dtype=torch.bool, device=device)
        for im in mb.images:
            mask[im.offset : im.offset + im.length] = True

        def placeholder_mask(input_ids, inputs_embeds, image_features=None, video_features=None):
            if (
                image_features is not None
                and int(mask.sum()) * inputs_embeds.shape[-1] != image_features.numel()
            ):
                raise ValueError(
                    f"row has {int(mask.sum())} image tokens, features for {image_features.shape[0]}"
                )
            return mask[None, :, None], torch.zeros_like(mask)[None, :, None]

        self._inner.get_placeholder_mask = placeholder_mask
        try:
            yield
        finally:
            del self._inner.get_placeholder_mask
