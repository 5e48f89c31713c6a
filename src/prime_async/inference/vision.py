"""The vision side of the embedded engine's forward (Qwen2.5-VL-style models): image embeddings from the
model's vision tower, and the multimodal rotary positions (M-RoPE) of a prompt with images.

Called by `inference/model_runner.py` on the engine thread only.

Invariants:
- `VisionTower.embeddings` runs the tower only on images whose key (`ImagePrompt.keys`: a digest of the
  pixel values and grid) is not cached; cached embeddings are reused until `clear()`, which the runner
  calls on every weight load (new weights: the tower's output changes), or until evicted (least recently
  used first, beyond `max_cached_tokens`; never an image of the prompt being embedded). A re-prefill of a
  retracted request, or the next turn of an episode resending its images, hits the cache under the same
  weights.
- `mrope_positions` gives what transformers' `get_rope_index` gives for an image-then-text prompt: text
  tokens advance all three axes together; an image's tokens take (t, h, w) grid positions from the
  current position, which then advances by max(h, w) / merge. The delta (max position + 1 - length)
  places every later token: its position is its index + delta on all three axes (decode).
- `model_names` is idempotent: either naming of a Qwen2.5-VL checkpoint loads.
- `MRope.cos_sin` equals the model's rotary module for 3-D positions: each frequency column takes the
  table row of its axis (sections `mrope_section`); for text tokens (three equal axes) it is the 1-D row.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from prime_async.inference.images import ImagePrompt


def model_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL tensors under the names of the loaded model: a checkpoint's (`save_pretrained`'s hub
    layout: `model.layers.*`, `visual.*`) become `model.language_model.*`, `model.visual.*`; names already in
    the model's layout (a trainer's `state_dict`) and `lm_head.*` are kept."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
            name = "model.language_model." + name[len("model.") :]
        out[name] = tensor
    return out


class VisionTower:
    """The model's vision tower (`get_image_features`) with an LRU cache of embeddings by image key."""

    def __init__(
        self, model, device: torch.device, dtype: torch.dtype, max_cached_tokens: int = 32768
    ) -> None:
        """`max_cached_tokens`: image tokens kept (least recently used evicted first; 32768 tokens of a
        7B model's width 3584 in bfloat16 are 235 MB)."""
        self.model = model  # the HF *ForConditionalGeneration's inner model (has get_image_features)
        self.device, self.dtype = device, dtype
        self.max_cached_tokens = max_cached_tokens
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cached_tokens = 0
        self.images_encoded = 0
        self.cache_hits = 0
        self.seconds = 0.0

    def clear(self) -> None:
        self._cache.clear()
        self._cached_tokens = 0

    def embeddings(self, image: ImagePrompt) -> list[torch.Tensor]:
        """Each image's embeddings (tokens, hidden), the uncached ones computed in one tower call."""
        missing: list[int] = []  # the first image of each key not cached
        for k, key in enumerate(image.keys):
            if key not in self._cache and key not in (image.keys[j] for j in missing):
                missing.append(k)
        self.cache_hits += len(image.keys) - len(missing)
        if missing:
            t0 = time.monotonic()
            pixels = torch.cat([image.patches(k) for k in missing]).to(self.device, self.dtype)
            grid = torch.tensor([image.grids[k] for k in missing], device=self.device)
            out = self.model.get_image_features(pixel_values=pixels, image_grid_thw=grid).pooler_output
            for k, emb in zip(missing, out, strict=True):
                self._cache[image.keys[k]] = emb
                self._cached_tokens += emb.shape[0]
            self.images_encoded += len(missing)
            self.seconds += time.monotonic() - t0
        embs = []
        for key in image.keys:
            self._cache.move_to_end(key)
            embs.append(self._cache[key])
        while self._cached_tokens > self.max_cached_tokens and len(self._cache) > len(set(image.keys)):
            self._cached_tokens -= self._cache.popitem(last=False)[1].shape[0]
        return embs


def mrope_positions(length: int, image: ImagePrompt, merge: int) -> tuple[torch.Tensor, int]:
    """(3, length) positions of a prompt whose first tokens are `image.ids` (later tokens are text) and
    its delta (see the module invariants)."""
    parts: list[torch.Tensor] = []
    pos = last = 0
    for (start, end), (t, h, w) in zip(image.runs, image.grids, strict=True):
        text = start - last
        parts.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        grid_t, grid_h, grid_w = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
        )
        parts.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        last = end
    parts.append(torch.arange(length - last).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - length


class MRope:
    """cos / signed-sin rows of 3-D positions from the runner's 1-D tables (`mrope_section` columns)."""

    def __init__(self, sections: list[int], head_dim: int, device: torch.device) -> None:
        axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
        assert axis.numel() * 2 == head_dim, f"mrope_section {sections} does not cover head_dim {head_dim}"
        self.axis = torch.cat([axis, axis]).to(device)  # (head_dim,): the axis each column reads

    def cos_sin(
        self, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, N) -> cos, signed sin (N, head_dim) from tables (max_len, head_dim)."""
        index = self.axis[None, None].expand(1, positions.shape[1], -1)
        pick = positions.to(cos.device)
        return cos[pick].gather(0, index)[0], sin_signed[pick].gather(0, index)[0]
