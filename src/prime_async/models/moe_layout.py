"""Expert weights of Qwen3-MoE models in the two layouts transformers uses.

- in memory (transformers 5 `Qwen3MoeExperts`): per layer `mlp.experts.gate_up_proj` (E, 2I, H), the gate
  rows first, and `mlp.experts.down_proj` (E, H, I);
- on disk (HF checkpoints, what SGLang and `from_pretrained` read): per expert
  `mlp.experts.{e}.gate_proj.weight` (I, H), `up_proj.weight` (I, H), `down_proj.weight` (H, I).

The trainer works on in-memory names; `split_experts` is applied when a version is published, and the
embedded engine applies `fuse_experts` when it reads a checkpoint. Invariant: the two are inverses, and
every other tensor passes through unchanged (dense models are untouched).
"""

from __future__ import annotations

import re

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<name>gate_proj|up_proj|down_proj)\.weight$"
)


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory names -> checkpoint names (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = tensor
            continue
        prefix = m["prefix"]
        for e in range(tensor.shape[0]):
            if m["name"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> in-memory names. A layer with missing experts raises ValueError naming it."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = tensor
        else:
            experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["name"]] = tensor
    for prefix, by_expert in experts.items():
        n = len(by_expert)
        if sorted(by_expert) != list(range(n)) or any(len(w) != 3 for w in by_expert.values()):
            raise ValueError(f"{prefix}: expert weights incomplete (experts {sorted(by_expert)})")
        ordered = [by_expert[e] for e in range(n)]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate_proj"], w["up_proj"]]) for w in ordered]
        )
        out[f"{prefix}.down_proj"] = torch.stack([w["down_proj"] for w in ordered])
    return out
