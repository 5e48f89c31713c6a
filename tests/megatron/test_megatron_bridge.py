"""HF <-> megatron name/shape mapping (pure tensor code, no megatron import): layouts, exact round trips."""

from __future__ import annotations

import pytest
import torch

from prime_async.trainer.megatron.bridge import (
    ModelShape,
    StageLayout,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    shard,
    unshard,
)

HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 16,
    "vocab_size": 50,
    "tie_word_embeddings": False,
}


def _hf_state_dict(shape: ModelShape, hidden: int = 16, ffn: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    sd = {
        "model.embed_tokens.weight": torch.randn(shape.vocab_size, hidden, generator=g),
        "model.norm.weight": torch.randn(hidden, generator=g),
        "lm_head.weight": torch.randn(shape.vocab_size, hidden, generator=g),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": torch.randn(hidden, generator=g),
                p + "post_attention_layernorm.weight": torch.randn(hidden, generator=g),
                p + "self_attn.q_proj.weight": torch.randn(q_rows, hidden, generator=g),
                p + "self_attn.k_proj.weight": torch.randn(kv_rows, hidden, generator=g),
                p + "self_attn.v_proj.weight": torch.randn(kv_rows, hidden, generator=g),
                p + "self_attn.q_proj.bias": torch.randn(q_rows, generator=g),
                p + "self_attn.k_proj.bias": torch.randn(kv_rows, generator=g),
                p + "self_attn.v_proj.bias": torch.randn(kv_rows, generator=g),
                p + "self_attn.o_proj.weight": torch.randn(hidden, q_rows, generator=g),
                p + "mlp.gate_proj.weight": torch.randn(ffn, hidden, generator=g),
                p + "mlp.up_proj.weight": torch.randn(ffn, hidden, generator=g),
                p + "mlp.down_proj.weight": torch.randn(hidden, ffn, generator=g),
            }
        )
    return sd


@pytest.fixture
def shape() -> ModelShape:
    return ModelShape.from_hf(HF, padded_vocab_size=padded_vocab_size(50, multiple=8, tp_size=2))


def test_padded_vocab_size() -> None:
    assert padded_vocab_size(1024, multiple=128, tp_size=1) == 1024
    assert padded_vocab_size(500, multiple=128, tp_size=2) == 512
    assert padded_vocab_size(151936, multiple=128, tp_size=8) == 152576


def test_shape_reads_family_flags(shape: ModelShape) -> None:
    assert (shape.family, shape.qkv_bias, shape.head_dim, shape.padded_vocab_size) == ("qwen2", True, 4, 64)


def test_qkv_fusion_is_per_query_group(shape: ModelShape) -> None:
    """megatron's fused rows: [q of group 0 (2 heads), k0, v0, q of group 1, k1, v1], head_dim rows each."""
    sd = _hf_state_dict(shape)
    full = hf_to_megatron(sd, shape, StageLayout(0, 4, True, True))
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"].split(shape.head_dim)
    q, k, v = (sd[f"model.layers.0.self_attn.{p}_proj.weight"].split(shape.head_dim) for p in "qkv")
    expected = [q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]]
    assert all(torch.equal(a, b) for a, b in zip(qkv, expected, strict=True))


def test_round_trip_is_exact_and_pads_vocab(shape: ModelShape) -> None:
    sd = _hf_state_dict(shape)
    stage = StageLayout(0, 4, True, True)
    full = hf_to_megatron(sd, shape, stage)
    assert full["embedding.word_embeddings.weight"].shape[0] == 64
    assert not full["output_layer.weight"][50:].any()
    back = megatron_to_hf(full, shape, stage)
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_pipeline_stages_split_layers_and_ends(shape: ModelShape) -> None:
    sd = _hf_state_dict(shape)
    first = hf_to_megatron(sd, shape, StageLayout(0, 2, True, False))
    last = hf_to_megatron(sd, shape, StageLayout(2, 2, False, True))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    # Local layer 0 of the last stage is global layer 2.
    assert torch.equal(
        last["decoder.layers.0.input_layernorm.weight"], sd["model.layers.2.input_layernorm.weight"]
    )
    merged = {
        **megatron_to_hf(first, shape, StageLayout(0, 2, True, False)),
        **megatron_to_hf(last, shape, StageLayout(2, 2, False, True)),
    }
    assert sorted(merged) == sorted(sd)


def test_tied_embeddings_last_stage_gets_its_own_copy() -> None:
    tied = ModelShape.from_hf({**HF, "tie_word_embeddings": True}, padded_vocab_size=64)
    sd = _hf_state_dict(tied)
    del sd["lm_head.weight"]
    single = hf_to_megatron(sd, tied, StageLayout(0, 4, True, True))
    assert "output_layer.weight" not in single
    last = hf_to_megatron(sd, tied, StageLayout(2, 2, False, True))
    assert torch.equal(last["output_layer.weight"][:50], sd["model.embed_tokens.weight"])
    assert "lm_head.weight" not in megatron_to_hf(last, tied, StageLayout(2, 2, False, True))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(shape: ModelShape, tp: int) -> None:
    full = hf_to_megatron(_hf_state_dict(shape), shape, StageLayout(0, 4, True, True))
    for name, tensor in full.items():
        if tp == 4 and "linear_qkv" in name:
            continue  # 2 kv groups cannot be split 4 ways (config validation refuses it)
        shards = [shard(name, tensor, r, tp) for r in range(tp)]
        assert torch.equal(unshard(name, shards), tensor), name


def test_fc1_shard_holds_gate_and_up_halves(shape: ModelShape) -> None:
    sd = _hf_state_dict(shape)
    full = hf_to_megatron(sd, shape, StageLayout(0, 4, True, True))
    rank1 = shard(
        "decoder.layers.0.mlp.linear_fc1.weight", full["decoder.layers.0.mlp.linear_fc1.weight"], 1, 2
    )
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(rank1, torch.cat([gate[12:], up[12:]]))
