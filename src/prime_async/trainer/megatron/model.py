"""Build a megatron-core GPTModel from an HF directory, load its weights, export them back to HF names.

Called by `trainer/megatron/backend.py` once per rank, after `torch.distributed` is initialised.

Steps, each a function: `init_parallel_state` (TP/PP groups from `MegatronConfig`), `build_gpt_model`
(TransformerConfig + local layer spec; its random init is overwritten by the HF weights),
`load_hf_weights` (each rank reads only the tensors of its pipeline stage and keeps its TP shard),
`export_hf_state_dict` (TP all-gather, PP gather to global rank 0, HF names).

Invariants: loading is strict (every megatron parameter is set, no HF tensor of the stage is left over);
`export_hf_state_dict(load_hf_weights(hf)) == hf` exactly on global rank 0; this module holds no CPU
workaround (`cpu_ranks.py` does that), only the `device` it is given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from safetensors import safe_open

from prime_async.config.megatron import MegatronConfig, num_experts, rope_settings
from prime_async.trainer.megatron.bridge import (
    ModelShape,
    StageLayout,
    expert_slice,
    hf_to_megatron,
    is_expert_param,
    megatron_to_hf,
    padded_vocab_size,
    shard,
    unshard,
)

logger = logging.getLogger(__name__)


def init_parallel_state(cfg: MegatronConfig) -> None:
    """Create megatron's TP/PP/DP groups over the already initialised default process group."""
    if mpu.model_parallel_is_initialized():
        return
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        expert_model_parallel_size=cfg.expert_parallel_size,
        expert_tensor_parallel_size=1,
    )
    if torch.cuda.is_available():
        # Seeds the CUDA RNG tracker megatron's TP layers fork from (dropout is 0, so only for API needs).
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


def transformer_config(hf: dict[str, Any], cfg: MegatronConfig, *, dtype: torch.dtype, device: torch.device):
    """megatron TransformerConfig equivalent to the HF config (dense, RMSNorm, SwiGLU, RoPE)."""
    shape = ModelShape.from_hf(hf, padded_vocab_size=hf["vocab_size"])
    tp = cfg.tensor_parallel_size
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.family in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        expert_model_parallel_size=cfg.expert_parallel_size,
        sequence_parallel=cfg.sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Micro-batches have different lengths; the P2P shapes of pipeline parallelism follow them (only
        # PP needs it, and megatron's allgather MoE dispatcher refuses it).
        variable_seq_lengths=cfg.pipeline_parallel_size > 1,
        # The shared loss is already each micro-batch's share of the batch loss (divided by the batch's
        # loss tokens): megatron must neither divide by micro-batches nor average over data-parallel
        # ranks. Set here, at construction: megatron's DDP reads it in its own constructor.
        calculate_per_token_loss=True,
        **_moe_settings(hf, cfg, device),
        use_cpu_initialization=device.type == "cpu",
        # Random init is overwritten by the HF weights, but megatron-core 0.16 sets the tensor-parallel
        # attributes of a weight (which grad-norm and optimizer sharding rely on) only inside its init.
        perform_initialization=True,
        # The fused kernels below need CUDA extensions (apex/TE) that are not dependencies of this project.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity="full" if cfg.recompute_activations else None,
        recompute_method="uniform" if cfg.recompute_activations else None,
        recompute_num_layers=1 if cfg.recompute_activations else None,
    )


def _moe_settings(hf: dict[str, Any], cfg: MegatronConfig, device: torch.device) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE model: every layer sparse, softmax over all experts then
    top-k renormalised (= megatron's top-k of the logits, then softmax over them), no load-balancing loss
    (RL fine-tuning keeps the routing the model has), experts not tensor-parallel. On CPU ranks the
    `allgather` dispatcher (megatron's `alltoall` one needs CUDA streams)."""
    experts = num_experts(hf)
    if not experts:
        return {"moe_token_dispatcher_type": "alltoall"}
    if not hf.get("norm_topk_prob", True):
        raise ValueError("trainer.megatron: MoE models without norm_topk_prob are not mapped")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": int(hf["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
        "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
        "expert_tensor_parallel_size": 1,
        "moe_token_dispatcher_type": "alltoall" if device.type == "cuda" else "allgather",
    }


def model_shape(hf: dict[str, Any], cfg: MegatronConfig) -> ModelShape:
    padded = padded_vocab_size(
        hf["vocab_size"], multiple=cfg.make_vocab_size_divisible_by, tp_size=cfg.tensor_parallel_size
    )
    return ModelShape.from_hf(hf, padded_vocab_size=padded)


def build_gpt_model(
    hf: dict[str, Any], cfg: MegatronConfig, *, dtype: torch.dtype, device: torch.device
) -> GPTModel:
    """This rank's GPTModel (its pipeline stage, its TP shards), randomly initialised."""
    tcfg = transformer_config(hf, cfg, dtype=dtype, device=device)
    rope = rope_settings(hf)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=tcfg.num_moe_experts,
            moe_grouped_gemm=False,
            qk_layernorm=tcfg.qk_layernorm,
            normalization="RMSNorm",
        ),
        vocab_size=model_shape(hf, cfg).padded_vocab_size,
        max_sequence_length=hf["max_position_embeddings"],
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        # Full-vocabulary logits on every TP rank, so the shared loss sees the same tensor as under FSDP.
        parallel_output=False,
        share_embeddings_and_output_weights=model_shape(hf, cfg).tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope["theta"]),
        rope_scaling=rope["type"] == "llama3",
        rope_scaling_factor=rope["factor"],
    )
    return model.to(device)


def stage_layout(model: GPTModel) -> StageLayout:
    return StageLayout(
        layer_offset=get_transformer_layer_offset(model.config),
        num_local_layers=len(model.decoder.layers),
        pre_process=model.pre_process,
        post_process=model.post_process,
    )


def _read_stage_tensors(model_path: Path, stage: StageLayout) -> dict[str, torch.Tensor]:
    """Only the HF tensors this pipeline stage needs (safetensors are read lazily per tensor)."""
    layers = range(stage.layer_offset, stage.layer_offset + stage.num_local_layers)
    wanted_prefixes = tuple(f"model.layers.{i}." for i in layers)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.startswith(wanted_prefixes) or not key.startswith("model.layers."):
                    out[key] = f.get_tensor(key)
    return out


@torch.no_grad()
def load_hf_weights(model: GPTModel, model_path: str | Path, hf: dict[str, Any], cfg: MegatronConfig) -> None:
    """Copy the HF safetensors of `model_path` into this rank's shard of `model` (strict)."""
    stage = stage_layout(model)
    shape = model_shape(hf, cfg)
    full = hf_to_megatron(_read_stage_tensors(Path(model_path), stage), shape, stage)
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    params = {_global_name(n, shape): p for n, p in model.named_parameters()}
    missing = sorted(set(params) - set(full))
    unexpected = sorted(n for n in set(full) - set(params) if not is_expert_param(n))  # others' experts
    assert not missing and not unexpected, f"HF->megatron mapping mismatch: {missing=} {unexpected=}"
    for name, param in params.items():
        src = shard(name, full[name], tp_rank, tp_size)
        assert src.shape == param.shape, (
            f"{name}: HF shard {tuple(src.shape)} != megatron {tuple(param.shape)}"
        )
        param.copy_(src.to(param.dtype))


def _gather_tp(name: str, tensor: torch.Tensor) -> torch.Tensor:
    tp_size = mpu.get_tensor_model_parallel_world_size()
    if tp_size == 1 or not _is_tp_sharded(name):
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return unshard(name, shards)


def _is_tp_sharded(name: str) -> bool:
    from prime_async.trainer.megatron.bridge import partition_dim

    return partition_dim(name) is not None


def _global_name(name: str, shape: ModelShape) -> str:
    """The parameter's name with global expert indices (expert parallelism holds a slice of them)."""
    if not shape.num_experts:
        return name
    per_rank = shape.num_experts // mpu.get_expert_model_parallel_world_size()
    return expert_slice(name, ep_rank=mpu.get_expert_model_parallel_rank(), experts_per_rank=per_rank)


def _gather_experts(full: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Every expert of the stage (global names) on every rank of the expert-parallel group."""
    local = {_global_name(n, shape): t for n, t in full.items()}
    if not shape.num_experts or mpu.get_expert_model_parallel_world_size() == 1:
        return local
    experts = {n: t.cpu() for n, t in local.items() if is_expert_param(n)}
    parts: list[Any] = [None] * mpu.get_expert_model_parallel_world_size()
    dist.all_gather_object(parts, experts, group=mpu.get_expert_model_parallel_group())
    for part in parts:
        local.update(part)
    return local


@torch.no_grad()
def export_hf_state_dict(model: GPTModel, hf: dict[str, Any], cfg: MegatronConfig) -> dict | None:
    """HF-named full tensors (on CPU) on global rank 0; None on every other rank.

    Every rank must call it (TP all-gathers, PP gather). Only data-parallel rank 0 contributes.
    """
    stage = stage_layout(model)
    full = {name: _gather_tp(name, p.detach()) for name, p in model.named_parameters()}
    full = _gather_experts(full, model_shape(hf, cfg))
    # Copies (never views of live parameters): the caller may keep them while training goes on. One dtype
    # for all tensors (megatron's local norms keep fp32 weights under bf16 training).
    dtype = model.config.params_dtype
    part = megatron_to_hf(
        {k: v.to("cpu", dtype=dtype, copy=True) for k, v in full.items()}, model_shape(hf, cfg), stage
    )
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return part if dist.get_rank() == 0 else None
    is_root = mpu.get_data_parallel_rank() == 0 and mpu.get_tensor_model_parallel_rank() == 0
    gathered: list[Any] | None = [None] * mpu.get_pipeline_model_parallel_world_size() if is_root else None
    if is_root:
        group = mpu.get_pipeline_model_parallel_group()
        dist.gather_object(part, gathered, dst=dist.get_global_rank(group, 0), group=group)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for piece in gathered or []:
        out.update(piece)
    return out
