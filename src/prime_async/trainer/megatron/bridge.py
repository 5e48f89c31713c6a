"""HF <-> megatron-core name/shape mapping for the dense Llama / Qwen2 / Qwen3 families and Qwen3-MoE.

Why not `mbridge`: mbridge 0.15.1 resolves with our pins, but it always builds the TransformerEngine layer
spec (`use_transformer_engine=True`, names like `linear_qkv.layer_norm_weight`) and CUDA-initialised
parameters, so it cannot build or test a model without TE and a GPU. This module maps the local
(megatron-core only) layer spec, which runs everywhere.

Layout facts the mapping encodes (megatron-core 0.16, local spec):
- `linear_qkv.weight` (and `.bias`) fuses q/k/v per query group: for each of the `num_kv_heads` groups,
  `[q heads of the group (heads/kv_heads * head_dim rows), k (head_dim rows), v (head_dim rows)]`. Tensor
  parallelism splits dim 0 into contiguous chunks, i.e. whole groups per rank.
- `linear_fc1.weight` is `[gate; up]` per tensor-parallel rank: rank r holds `cat(gate_r, up_r)`.
- row-parallel weights (`linear_proj`, `linear_fc2`) split dim 1; embedding and output layer split the
  (padded) vocabulary, dim 0; norms are replicated.
- HF `input_layernorm` / `post_attention_layernorm` are `input_layernorm` / `pre_mlp_layernorm`; q/k norms are
  `self_attention.{q,k}_layernorm`.
- MoE (Qwen3-MoE, SequentialMLP experts): HF `mlp.gate.weight` is `mlp.router.weight`; expert e's
  gate/up/down are `mlp.experts.local_experts.{e}.linear_fc1.weight` ([gate; up]) and `linear_fc2.weight`.
  The full dicts here use global expert indices; under expert parallelism a rank's local index l is
  global `ep_rank * experts_per_rank + l` (`expert_slice`).

Invariants: `megatron_to_hf(hf_to_megatron(sd)) == sd` exactly (tensor for tensor), and
`unshard(shard(t, r) for r) == t`; the vocabulary padding rows are zeros on load and dropped on export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from prime_async.config.megatron import SUPPORTED_ARCHITECTURES, num_experts


@dataclass(frozen=True)
class ModelShape:
    """The few HF config numbers the mapping needs."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    num_experts: int = 0  # routed experts per layer (0 = dense MLPs)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, padded_vocab_size: int) -> ModelShape:
        family = SUPPORTED_ARCHITECTURES[hf["architectures"][0]]
        heads = hf["num_attention_heads"]
        return cls(
            family=family,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            padded_vocab_size=padded_vocab_size,
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            num_experts=num_experts(hf),
        )


def padded_vocab_size(vocab_size: int, *, multiple: int, tp_size: int) -> int:
    """Smallest multiple of `multiple * tp_size` >= vocab_size (megatron splits the vocab evenly over TP)."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step


_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v (rows = heads * head_dim) -> megatron's per-group [q..., k, v] row layout."""
    groups, per_group = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    rest = q.shape[1:]
    q_g = q.reshape(groups, per_group * shape.head_dim, *rest)
    k_g = k.reshape(groups, shape.head_dim, *rest)
    v_g = v.reshape(groups, shape.head_dim, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per_group + 2) * shape.head_dim, *rest)
    q, k, v = torch.split(g, [per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_vocab(weight: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    pad = shape.padded_vocab_size - weight.shape[0]
    return torch.cat([weight, weight.new_zeros(pad, *weight.shape[1:])]) if pad else weight


def hf_layer_to_megatron(hf_sd: dict[str, torch.Tensor], i: int, j: int, shape: ModelShape) -> dict:
    """HF tensors of global layer `i` -> full (unsharded) megatron tensors of local layer `j`."""
    src, dst = f"model.layers.{i}.", f"decoder.layers.{j}."
    out = {dst + m: hf_sd[src + h] for m, h in _LAYER_RENAMES.items() if src + h in hf_sd}
    qkv = [hf_sd[f"{src}self_attn.{p}_proj.weight"] for p in "qkv"]
    out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(*qkv, shape)
    if shape.qkv_bias:
        bias = [hf_sd[f"{src}self_attn.{p}_proj.bias"] for p in "qkv"]
        out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(*bias, shape)
    if shape.num_experts:
        out.update(_hf_experts_to_megatron(hf_sd, src, dst, shape.num_experts))
        return out
    gate, up = hf_sd[src + "mlp.gate_proj.weight"], hf_sd[src + "mlp.up_proj.weight"]
    out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    return out


def _hf_experts_to_megatron(hf_sd: dict, src: str, dst: str, num_experts: int) -> dict:
    """Router and experts of one MoE layer; experts keep their global index here (`expert_slice` maps
    them to a rank's local ones)."""
    out = {dst + "mlp.router.weight": hf_sd[src + "mlp.gate.weight"]}
    for e in range(num_experts):
        hf_e, m_e = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}."
        gate, up = hf_sd[hf_e + "gate_proj.weight"], hf_sd[hf_e + "up_proj.weight"]
        out[m_e + "linear_fc1.weight"] = torch.cat([gate, up])
        out[m_e + "linear_fc2.weight"] = hf_sd[hf_e + "down_proj.weight"]
    return out


def _megatron_experts_to_hf(m_sd: dict, src: str, dst: str, num_experts: int) -> dict:
    out = {dst + "mlp.gate.weight": m_sd[src + "mlp.router.weight"]}
    for e in range(num_experts):
        m_e, hf_e = f"{src}mlp.experts.local_experts.{e}.", f"{dst}mlp.experts.{e}."
        gate, up = m_sd[m_e + "linear_fc1.weight"].chunk(2)
        out[hf_e + "gate_proj.weight"], out[hf_e + "up_proj.weight"] = gate, up
        out[hf_e + "down_proj.weight"] = m_sd[m_e + "linear_fc2.weight"]
    return out


_LOCAL_EXPERT = re.compile(r"^(?P<head>.*\.mlp\.experts\.local_experts\.)(?P<e>\d+)(?P<tail>\..*)$")


def expert_slice(name: str, *, ep_rank: int, experts_per_rank: int) -> str:
    """A rank's local expert parameter name -> the name with the expert's global index (others unchanged).
    Expert parallelism gives rank r the experts [r * per_rank, (r + 1) * per_rank)."""
    m = _LOCAL_EXPERT.match(name)
    if m is None:
        return name
    return f"{m['head']}{ep_rank * experts_per_rank + int(m['e'])}{m['tail']}"


def is_expert_param(name: str) -> bool:
    return _LOCAL_EXPERT.match(name) is not None


def megatron_layer_to_hf(m_sd: dict[str, torch.Tensor], j: int, i: int, shape: ModelShape) -> dict:
    """Full megatron tensors of local layer `j` -> HF tensors of global layer `i`."""
    src, dst = f"decoder.layers.{j}.", f"model.layers.{i}."
    out = {dst + h: m_sd[src + m] for m, h in _LAYER_RENAMES.items() if src + m in m_sd}
    q, k, v = _split_qkv(m_sd[src + "self_attention.linear_qkv.weight"], shape)
    out.update({f"{dst}self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v), strict=True)})
    if shape.qkv_bias:
        q, k, v = _split_qkv(m_sd[src + "self_attention.linear_qkv.bias"], shape)
        out.update({f"{dst}self_attn.{p}_proj.bias": t for p, t in zip("qkv", (q, k, v), strict=True)})
    if shape.num_experts:
        out.update(_megatron_experts_to_hf(m_sd, src, dst, shape.num_experts))
        return out
    gate, up = m_sd[src + "mlp.linear_fc1.weight"].chunk(2)
    out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    return out


@dataclass(frozen=True)
class StageLayout:
    """Which part of the model one pipeline stage holds."""

    layer_offset: int
    num_local_layers: int
    pre_process: bool
    post_process: bool


def hf_to_megatron(hf_sd: dict[str, torch.Tensor], shape: ModelShape, stage: StageLayout) -> dict:
    """HF state dict -> full (unsharded) megatron state dict of one pipeline stage."""
    out: dict[str, torch.Tensor] = {}
    embed = hf_sd["model.embed_tokens.weight"]
    if stage.pre_process:
        out["embedding.word_embeddings.weight"] = _pad_vocab(embed, shape)
    for j in range(stage.num_local_layers):
        out.update(hf_layer_to_megatron(hf_sd, stage.layer_offset + j, j, shape))
    if stage.post_process:
        out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
        # With tied embeddings and PP > 1 the last stage holds its own copy of the embedding as output layer.
        head = embed if shape.tied_embeddings else hf_sd["lm_head.weight"]
        if not (shape.tied_embeddings and stage.pre_process):
            out["output_layer.weight"] = _pad_vocab(head, shape)
    return out


def megatron_to_hf(m_sd: dict[str, torch.Tensor], shape: ModelShape, stage: StageLayout) -> dict:
    """Full megatron state dict of one pipeline stage -> HF tensors (vocab padding dropped)."""
    out: dict[str, torch.Tensor] = {}
    if stage.pre_process:
        out["model.embed_tokens.weight"] = m_sd["embedding.word_embeddings.weight"][: shape.vocab_size]
    for j in range(stage.num_local_layers):
        out.update(megatron_layer_to_hf(m_sd, j, stage.layer_offset + j, shape))
    if stage.post_process:
        out["model.norm.weight"] = m_sd["decoder.final_layernorm.weight"]
        if not shape.tied_embeddings:
            out["lm_head.weight"] = m_sd["output_layer.weight"][: shape.vocab_size]
    return out


def partition_dim(name: str) -> int | None:
    """Tensor-parallel split dim of a megatron parameter (None = replicated; experts are not TP-split)."""
    if is_expert_param(name) or name.endswith("mlp.router.weight"):
        return None
    if name.endswith(
        ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
    ):
        return 0
    if name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's tensor-parallel shard of a full megatron tensor."""
    dim = partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return full.chunk(tp_size, dim=dim)[tp_rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from all ranks' shards, in rank order."""
    dim = partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=dim)
