"""LoRA adapters of the embedded engine: read a PEFT adapter directory, fold it into the runner's fused
projections, apply it unmerged to the rows of the requests that name it.

    adapter dir (adapter_config.json + adapter_model.safetensors)
        ──read_adapter──► RawAdapter {(layer, module): (A (r, in), B (out, r))}, scaling = alpha / r
        ──fold (ModelRunner)──► per layer and fused projection: (A_f (R, in), B_f (out, R))
    forward: y = W_f x (+ b)  then  y[rows] += (x[rows] A_f^T) B_f^T for every adapter in the batch

Used by `inference/model_runner.py` (folding, forward) and `inference/engine.py` (registry).

Invariants:
- folding is exact algebra on the runner's fused layout (projections see the same input as HF's, norm
  gain applied): the scaling multiplies B, q/k/v (gate/up) adapters stack along the rank with a
  block-diagonal B;
- an adapter never changes the base weights: rows of requests without an adapter compute exactly the
  base model, and several adapters serve in one batch;
- `read_adapter` validates everything (peft type, rank bound, modules, names, shapes, finiteness) before
  the engine registers it: a bad adapter raises ValueError and changes nothing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prime_async.weights.broadcasts import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.(?:language_model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
"""A decoder layer's LoRA tensor; a vision-language model's decoder layers sit under `language_model.`."""


@dataclass
class RawAdapter:
    """An adapter as PEFT stores it: `pairs[(layer, module)] = (A, B)`, update `scaling * B A x`."""

    name: str
    path: str
    rank: int
    scaling: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Adapter:
    """A registered adapter: raw tensors plus the runner-folded pairs `layers[i][fused] = (A_f, B_f)`."""

    raw: RawAdapter
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    refs: int = 0  # requests submitted with it and not yet resolved (asyncio side)

    @property
    def name(self) -> str:
        return self.raw.name


def _config(directory: Path, max_rank: int | None) -> tuple[int, float]:
    cfg = read_adapter_config(directory)
    path = directory / ADAPTER_CONFIG  # named in the errors below
    for key in ("use_dora", "use_rslora"):
        if cfg.get(key):
            raise ValueError(f"{path}: {key} = true is not served by the embedded engine")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{path}: per-module rank_pattern / alpha_pattern are not served")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save {cfg['modules_to_save']} are not served (adapters only)")
    rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", 0))
    if rank < 1 or not math.isfinite(alpha):
        raise ValueError(f"{path}: r = {cfg.get('r')!r}, lora_alpha = {cfg.get('lora_alpha')!r} are invalid")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"{path}: rank {rank} exceeds the engine's max LoRA rank {max_rank} (lora.rank)")
    return rank, alpha / rank


def read_adapter(
    name: str, path: str, *, num_layers: int, shapes: dict[str, tuple[int, int]], max_rank: int | None,
    allowed: set[str] | None = None,
) -> RawAdapter:  # fmt: skip
    """Validate and read `path`; `shapes[module] = (out, in)` of the base model's linear layers."""
    from safetensors.torch import load_file

    directory = Path(path)
    rank, scaling = _config(directory, max_rank)
    try:
        state = load_file(str(directory / ADAPTER_WEIGHTS))
    except Exception as exc:  # missing / truncated / corrupt file
        raise ValueError(f"unreadable adapter weights in {path}: {type(exc).__name__}: {exc}") from exc
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULES or int(m.group(1)) >= num_layers:
            raise ValueError(f"adapter {path}: tensor {key!r} is not a LoRA weight of this model's layers")
        if allowed is not None and m.group(2) not in allowed:
            raise ValueError(
                f"adapter {path}: module {m.group(2)} is not in the engine's lora.target_modules"
            )
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise ValueError(f"adapter {path}: {key} is not a finite float tensor")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    pairs = {}
    for (layer, module), ab in sorted(halves.items()):
        out_f, in_f = shapes[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise ValueError(
                f"adapter {path}: layer {layer} {module} needs lora_A ({rank}, {in_f}) and lora_B "
                f"({out_f}, {rank}); got {None if a is None else tuple(a.shape)}, "
                f"{None if b is None else tuple(b.shape)}"
            )
        pairs[(layer, module)] = (a, b)
    if not pairs:
        raise ValueError(f"adapter {path} holds no LoRA weights")
    return RawAdapter(name=name, path=str(path), rank=rank, scaling=scaling, pairs=pairs)


def stack_pairs(
    parts: list[tuple[torch.Tensor, torch.Tensor] | None], out_sizes: list[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Fuse per-module (A, B) pairs (None: no adapter on that module) into one low-rank pair over the
    concatenated output rows: A stacked along the rank, B block-diagonal."""
    present = [(i, p) for i, p in enumerate(parts) if p is not None]
    if not present:
        return None
    a = torch.cat([p[0] for _, p in present])
    b = torch.zeros(sum(out_sizes), a.shape[0], dtype=a.dtype, device=a.device)
    starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
    col = 0
    for i, (_, pb) in present:
        b[starts[i] : starts[i] + out_sizes[i], col : col + pb.shape[1]] = pb
        col += pb.shape[1]
    return a.contiguous(), b.contiguous()


def apply_adapters(
    y: torch.Tensor, x: torch.Tensor, groups: list[tuple[Adapter, torch.Tensor | None]], layer: int, name: str
) -> torch.Tensor:
    """`y` plus every adapter's update on its rows (`rows` None: all rows)."""
    for adapter, rows in groups:
        pair = adapter.layers[layer].get(name)
        if pair is None:
            continue
        a, b = pair
        y = y + (x @ a.T) @ b.T if rows is None else y.index_add(0, rows, (x[rows] @ a.T) @ b.T)
    return y
