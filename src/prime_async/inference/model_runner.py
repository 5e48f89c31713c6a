"""Forward passes of a Llama/Qwen-family HF model over a slot-indexed, preallocated KV cache.

Called only by the engine thread (`inference/engine.py`); not thread-safe. The model is loaded with
`AutoModelForCausalLM` from a local directory; the forward is our own (same math as HF: RMSNorm, RoPE
from the model's own rotary module, GQA attention with SDPA, SwiGLU MLP) so that a decode step over B
requests of different lengths is one batched pass without padding the queries.

Invariants:
- KV slot i holds request i of the running batch; slots 0..B-1 are always the running ones (the engine
  compacts with `move_slot` when a request leaves), so a decode step slices the cache without copies.
- Slot `s` holds positions [0, length) of its request; `decode` writes position `pos[b]` and attends to
  [0, pos[b]].
- `load_weights` validates every name and shape before touching a parameter: on error nothing changes.
- q/k/v (and their biases) and gate/up of every layer are views of one contiguous buffer each
  (`_share_storage`, bound once at construction): copying a weight version into the HF parameters fills
  the fused projections too, so a load only copies and re-packs (no concatenation, no folded copies);
  RMSNorm gains and the attention scale are applied to the activations, as HF does.
- MoE (Qwen3-MoE): each sparse layer routes every row to its top-k experts with transformers' math; the
  experts chosen in a forward are kept for `take_routes` (routing replay, R3), one (N, k) per layer.
- Every tensor a decode step reads is a parameter, the KV cache, a rope table or a buffer made once
  (`_bind_fused_params`): a weight load copies into them in place (never rebinds), so a captured decode
  step (`inference/static_decode.py`) sees the new weights. Only CPU's oneDNN-packed copies are rebuilt,
  and graphs run on CUDA only, where nothing is packed.
- Vision-language models (`VISION_MODEL_TYPES`): a prompt's images are embedded by the vision tower
  (`inference/vision.py`, cached by image until the next weight load) into its placeholder rows at
  prefill, with M-RoPE positions; slot s decodes at rope position `position + rope_offset[s]` (the
  prompt's delta, 0 without images), which prefill sets and `move_slot` moves with the slot.
- Decode has two paths with the same math: `decode` (eager: shapes follow the batch, MoE experts run
  on their routed rows only, LoRA served) and `decode_rows` through `StaticDecoder` (shapes padded to a
  batch bucket and a span, no host sync; used unless `decode_step = "eager"` or a row has an adapter).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from prime_async.inference.images import ImagePrompt
from prime_async.inference.linear import Kernels, Projection
from prime_async.inference.lora import Adapter, RawAdapter, apply_adapters, stack_pairs
from prime_async.inference.static_decode import CudaGraphs, DecodeStep, StaticDecoder, resolve_decode_step
from prime_async.inference.vision import MRope, VisionTower, model_names, mrope_positions
from prime_async.models.moe_layout import fuse_experts
from prime_async.utils.dtypes import resolve_dtype

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_5_vl"}
VISION_MODEL_TYPES = {"qwen2_5_vl"}
"""Vision-language models: loaded with `AutoModelForImageTextToText`, the language model forward is ours,
the vision tower transformers' (`inference/vision.py`)."""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's RMSNorm: `weight * (x / rms(x))` with the statistics in fp32 and the normalised x rounded to
    x's dtype before the gain. On CUDA torch's fused kernel (one kernel instead of ~8: a decode step is
    launch-bound there); on CPU hand-written (F.rms_norm decomposes into ~10 ops with dtype round trips)."""
    if x.is_cuda:
        return _rms_norm_fused(x, weight, eps)
    xf = x.float() if x.dtype != torch.float32 else x
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if weight is None else weight * out


def _rms_norm_fused(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`_rms_norm` by `F.rms_norm` (fp32 statistics inside), the gain applied after the rounding as HF does
    (and because the q/k-norm gain differs per head: (heads, D), not F.rms_norm's (D,))."""
    out = F.rms_norm(x, (x.shape[-1],), eps=eps)
    return out if weight is None else weight * out


@torch.no_grad()
def _share_storage(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Make `params` (same trailing shape) consecutive row blocks of one new contiguous buffer, which is
    returned; their values are kept."""
    buffer = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = buffer[start : start + p.shape[0]]
        start += p.shape[0]
    return buffer


def _is_moe(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _moe_weights(mlp) -> dict:
    """A sparse MoE block's weights in the layout of transformers' `Qwen3MoeExperts` (used as they are)."""
    router, experts = mlp.gate, mlp.experts
    return {"moe": {"router": router.weight, "gate_up": experts.gate_up_proj, "down": experts.down_proj,
                    "act": experts.act_fn, "top_k": int(router.top_k),
                    "norm_topk_prob": bool(router.norm_topk_prob)}}  # fmt: skip


def _joint_norm_weight(att, num_heads: int, num_kv_heads: int) -> torch.Tensor | None:
    """q_norm / k_norm weights (Qwen3) stacked per head: (H + KVH, D), or None without qk-norm."""
    if getattr(att, "q_norm", None) is None:
        return None
    q_w, k_w = att.q_norm.weight, att.k_norm.weight
    return torch.cat([q_w.expand(num_heads, -1), k_w.expand(num_kv_heads, -1)])


def _load_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model of `model_path` (ValueError for a model type the forward does not implement)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_type = AutoConfig.from_pretrained(model_path).model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} unsupported by the torch engine: use sglang")
    auto = AutoModelForImageTextToText if model_type in VISION_MODEL_TYPES else AutoModelForCausalLM
    return auto.from_pretrained(model_path, dtype=dtype)


class ModelRunner:
    """Owns the model weights (fused in place, plus packed copies for speed) and the KV cache."""

    def __init__(
        self,
        *,
        model_path: str,
        dtype: str,
        device: str,
        num_slots: int,
        max_len: int,
        chunk: int,
        kernels: Kernels = "packed",
        decode_step: DecodeStep = "eager",
        decode_buckets: list[int] | None = None,
    ):
        """`decode_step`: how `decode_rows` runs (`static_decode.resolve_decode_step`); `decode_buckets`:
        the batch sizes its steps are padded to (None: powers of two up to `num_slots`)."""
        self.device = torch.device(device)
        torch_dtype = resolve_dtype(dtype, self.device)
        self.model = _load_model(model_path, torch_dtype).to(self.device).eval()
        vlm = self.model.config.model_type in VISION_MODEL_TYPES
        self.lm = self.model.model.language_model if vlm else self.model.model  # the decoder stack
        cfg = self.text_config = self.model.config.get_text_config()
        self.vision = VisionTower(self.model.model, self.device, torch_dtype) if vlm else None
        self.merge = int(self.model.config.vision_config.spatial_merge_size) if vlm else 1
        self.dtype = torch_dtype
        self.vocab_size = int(cfg.vocab_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.num_slots, self.max_len, self.chunk = num_slots, max_len, chunk
        self.kernels = kernels
        self.adapters: dict[str, Adapter] = {}  # loaded LoRA adapters by name (engine thread)
        self._routes: list[torch.Tensor] = []  # MoE: experts chosen per layer in the current forward
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []  # adapters of the current forward
        self._build_rope_table()
        self.mrope = MRope(cfg.rope_parameters["mrope_section"], self.head_dim, self.device) if vlm else None
        with torch.inference_mode():  # written in place by prefill and move_slot (a decode graph reads it)
            self.rope_offset = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self._stale_fused = False  # a partial load happened: rebuild the derived weights first
        self._fused = self._bind_fused_params()
        self._fuse_weights()
        self.capacity = 0
        self.cache_generation = 0  # bumped whenever the cache tensors are reallocated
        self.keep_cache_on_flush = False  # set by a capturing StaticDecoder: graphs read these tensors
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.ensure_capacity(min(chunk, max_len))
        self.static = self._static_decoder(decode_step, decode_buckets)

    def _static_decoder(self, step: DecodeStep, buckets: list[int] | None) -> StaticDecoder | None:
        mode = resolve_decode_step(step, self.device)
        if mode == "eager":
            return None
        capture = CudaGraphs(self.device) if mode == "graphs" else None
        return StaticDecoder(self, buckets, capture)

    # ---- weights -------------------------------------------------------------------------------------
    def _build_rope_table(self) -> None:
        """cos/sin for every position once (rope scaling included, via the model's rotary module)."""
        pos = torch.arange(self.max_len, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.lm.rotary_emb(probe, pos)
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * cat(-sin1, sin2): one roll instead of a (D, D) matmul
        self.cos = cos[0]  # (max_len, head_dim)
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    @torch.no_grad()
    def _bind_fused_params(self) -> list[dict[str, torch.Tensor]]:
        """Once: per layer, the buffers that q/k/v (weights, biases) and gate/up share (`_share_storage`)."""
        fused = []
        for layer in self.lm.layers:
            att, mlp = layer.self_attn, layer.mlp
            bufs = {"qkv": _share_storage([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])}
            if not _is_moe(mlp):
                bufs["gate_up"] = _share_storage([mlp.gate_proj.weight, mlp.up_proj.weight])
            if att.q_proj.bias is not None:
                bufs["qkv_bias"] = _share_storage([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
            qk_norm = _joint_norm_weight(att, self.num_heads, self.num_kv_heads)
            if qk_norm is not None:  # refilled in place by `_fuse_weights` (a decode graph reads it)
                bufs["qk_norm"] = qk_norm
            fused.append(bufs)
        return fused

    @torch.no_grad()
    def _fuse_weights(self) -> None:
        """The projections of the forward (rebuilt after every weight load): the shared q/k/v and gate/up
        buffers, o, down and the LM head, each packed for the device's fastest kernel (`linear.py`)."""
        self.layers = []
        for layer, bufs in zip(self.lm.layers, self._fused, strict=True):
            att, mlp = layer.self_attn, layer.mlp
            if "qk_norm" in bufs:
                bufs["qk_norm"].copy_(_joint_norm_weight(att, self.num_heads, self.num_kv_heads))
            self.layers.append(
                {
                    "index": len(self.layers),
                    "qkv": self._projection(bufs["qkv"], bufs.get("qkv_bias")),
                    "o": self._projection(att.o_proj.weight, att.o_proj.bias),
                    "qk_norm": bufs.get("qk_norm"),
                    "norm_in": layer.input_layernorm.weight,
                    "norm_post": layer.post_attention_layernorm.weight,
                    **(_moe_weights(mlp) if _is_moe(mlp) else self._dense_mlp(mlp, bufs)),
                }
            )
        self.embed = self.lm.embed_tokens.weight
        self.final_norm = self.lm.norm.weight
        self.lm_head = self._projection(self.model.get_output_embeddings().weight)
        for adapter in self.adapters.values():  # folded with the norm gains: refold on new base weights
            adapter.layers = self.fold_adapter(adapter.raw)

    def _dense_mlp(self, mlp, bufs: dict[str, torch.Tensor]) -> dict:
        return {"gate_up": self._projection(bufs["gate_up"]), "down": self._projection(mlp.down_proj.weight),
                "act": mlp.act_fn}  # fmt: skip

    @property
    def is_moe(self) -> bool:
        return any("moe" in lw for lw in self.layers)

    # ---- LoRA adapters (see inference/lora.py) -------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of every adaptable linear module of the (uniform) decoder layers."""
        layer = self.lm.layers[0]
        mods = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
        return {n: tuple(m.weight.shape) for n, m in mods.items() if isinstance(m, torch.nn.Linear)}

    @torch.no_grad()
    def fold_adapter(self, raw: RawAdapter) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """`raw` in the fused layout of `_fuse_weights` (the scaling folded into B)."""
        if self.is_moe:
            raise ValueError("LoRA adapters on MoE models are not supported by the embedded engine")
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        layers = []
        for i, layer in enumerate(self.lm.layers):

            def pair(module: str, i: int = i):
                found = raw.pairs.get((i, module))
                if found is None:
                    return None
                a, b = (t.to(device=self.device, dtype=torch.float32) for t in found)
                return a.to(self.dtype), (b * raw.scaling).to(self.dtype)

            inter = layer.mlp.gate_proj.weight.shape[0]
            fused = {
                "qkv": stack_pairs(
                    [pair("q_proj"), pair("k_proj"), pair("v_proj")], [h * d, kvh * d, kvh * d]
                ),
                "o": pair("o_proj"),
                "gate_up": stack_pairs([pair("gate_proj"), pair("up_proj")], [inter, inter]),
                "down": pair("down_proj"),
            }
            layers.append({k: v for k, v in fused.items() if v is not None})
        return layers

    def _set_groups(self, adapters: list[Adapter | None] | None, rows_per_item: list[int]) -> None:
        """Rows of the next forward per adapter; item j covers `rows_per_item[j]` consecutive rows."""
        self._groups = []
        if not adapters or all(a is None for a in adapters):
            return
        starts = [sum(rows_per_item[:j]) for j in range(len(rows_per_item))]
        for adapter in {id(a): a for a in adapters if a is not None}.values():
            items = [j for j, a in enumerate(adapters) if a is adapter]
            if len(items) == len(adapters):
                self._groups.append((adapter, None))
                continue
            rows = [r for j in items for r in range(starts[j], starts[j] + rows_per_item[j])]
            self._groups.append((adapter, torch.tensor(rows, device=self.device)))

    def _proj(self, lw: dict, name: str, x: torch.Tensor) -> torch.Tensor:
        y = lw[name](x)
        return apply_adapters(y, x, self._groups, lw["index"], name) if self._groups else y

    def _projection(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Projection:
        return Projection(weight, bias, kernels=self.kernels)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes a weight directory must provide (tied duplicates optional)."""
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_weights(self, model_path: str) -> int:
        """Validate then copy safetensors from `model_path`; raise ValueError and change nothing on error."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors in {model_path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as exc:  # truncated/corrupt file (SafetensorError) or vanished file (OSError)
                raise ValueError(f"unreadable weights file {f}: {type(exc).__name__}: {exc}") from exc
        try:
            state = fuse_experts(state)  # MoE checkpoints name each expert; the model fuses them
        except ValueError as exc:
            raise ValueError(f"weights in {model_path}: {exc}") from exc
        return self.load_state(state, source=model_path)

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor], *, source: str, partial: bool = False) -> int:
        """Validate then copy `state` into the model; ValueError naming `source` and nothing changed on
        error. `partial`: a subset of the tensors (one bucket of a distributed update); the derived
        weights are rebuilt before the next forward. Returns the number of tensors copied."""
        if self.vision is not None:
            state = model_names(state)
        expected = self.expected_tensors()
        sd = self.model.state_dict()
        missing = [] if partial else sorted(set(expected) - set(state))
        unknown = sorted(set(state) - set(sd))
        if missing or unknown:
            raise ValueError(f"weights in {source}: missing {missing[:5]}, unknown {unknown[:5]}")
        params = dict(self.model.named_parameters())
        for name, t in state.items():
            want = expected.get(name) or tuple(sd[name].shape)
            if tuple(t.shape) != want:
                raise ValueError(f"weights in {source}: {name} has shape {tuple(t.shape)}, expected {want}")
            if name in params and not t.is_floating_point():
                raise ValueError(f"weights in {source}: {name} has non-float dtype {t.dtype}")
        targets = params if not partial else {n: params.get(n, sd[n]) for n in state}
        for name, p in targets.items():
            p.copy_(state[name].to(device=self.device, dtype=p.dtype))
        if self.vision is not None:  # image embeddings of the old weights
            self.vision.clear()
        if partial:
            self._stale_fused = True
        else:
            self._fuse_weights()
        return len(targets)

    def _refresh_fused(self) -> None:
        if self._stale_fused:
            self._fuse_weights()
            self._stale_fused = False

    # ---- KV cache ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def ensure_capacity(self, length: int) -> None:
        """Grow every slot to hold `length` positions (doubling, chunk-aligned, <= max_len)."""
        if length <= self.capacity:
            return
        assert length <= self.max_len, f"length {length} exceeds max_len {self.max_len}"
        # geometric growth: O(log) reallocations (each copies every slot) over a long request
        cap = min(self.max_len, -(-max(length, 2 * self.capacity) // self.chunk) * self.chunk)
        shape = (self.num_slots, self.num_kv_heads, cap, self.head_dim)
        new_k, new_v = [], []
        for i in range(len(self.layers)):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.capacity:
                k[:, :, : self.capacity] = self.k_cache[i]
                v[:, :, : self.capacity] = self.v_cache[i]
            new_k.append(k)
            new_v.append(v)
        self.k_cache, self.v_cache, self.capacity = new_k, new_v, cap
        self.cache_generation += 1

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst` (compaction).

        Inference mode: the cache tensors are created inside the inference-mode forward, and an in-place
        write to an inference tensor outside inference mode raises (compaction also runs on abort/pause).
        """
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]
        self.rope_offset[dst] = self.rope_offset[src]

    @torch.inference_mode()
    def free_cache(self) -> None:
        """Drop the cache back to one chunk (used by flush when nothing holds KV); kept as it is while
        decode graphs read it (`keep_cache_on_flush`): nothing is cached across requests anyway."""
        if self.keep_cache_on_flush:
            return
        self.capacity = 0
        self.k_cache, self.v_cache = [], []
        self.ensure_capacity(min(self.chunk, self.max_len))

    # ---- forward -------------------------------------------------------------------------------------
    def _qkv(self, lw: dict, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        """x (N, hidden) -> q (N, H, D), k/v (N, KVH, D) with q/k-norm and RoPE applied (cos and the signed
        sin of `_build_rope_table` at each row's position)."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._proj(lw, "qkv", x)
        # q and k heads side by side (N, H + KVH, D): one norm and one RoPE for both (fewer CPU ops)
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk, v = qk.reshape(-1, h + kvh, d), v.view(-1, kvh, d)
        if lw["qk_norm"] is not None:
            qk = _rms_norm(qk, lw["qk_norm"], self.eps)
        qk = torch.addcmul(qk * cos[:, None], qk.roll(d // 2, -1), sin_signed[:, None])
        return qk[:, :h], qk[:, h:], v

    def _mlp(
        self, lw: dict, h: torch.Tensor, routes: list[torch.Tensor], static: bool = False
    ) -> torch.Tensor:
        x = _rms_norm(h, lw["norm_post"], self.eps)
        if "moe" in lw:
            experts = self._experts_static if static else self._experts
            return h + experts(lw["moe"], x, routes)
        gate, up = self._proj(lw, "gate_up", x).chunk(2, dim=-1)
        return h + self._proj(lw, "down", lw["act"](gate) * up)

    @staticmethod
    def _route(moe: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (weights, experts) of every row, as transformers' Qwen3-MoE router computes them."""
        probs = F.linear(x, moe["router"]).float().softmax(-1)
        weights, experts = probs.topk(moe["top_k"], dim=-1)
        if moe["norm_topk_prob"]:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts

    def _experts(self, moe: dict, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        """Top-k routed SwiGLU experts, as transformers' Qwen3-MoE block computes them; the chosen experts
        of every row are appended to `routes` (one (N, k) tensor per layer)."""
        weights, experts = self._route(moe, x)
        routes.append(experts)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, rank = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], moe["gate_up"][e]).chunk(2, dim=-1)
            y = F.linear(moe["act"](gate) * up, moe["down"][e]) * weights[rows, rank, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def _experts_static(self, moe: dict, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        """`_experts` with no host sync and shapes fixed by x's row count (a CUDA graph can capture it):
        with rows * top_k <= experts, each row runs its chosen experts' gathered weights; otherwise every
        expert runs on every row with weight 0 where not chosen (each expert read once)."""
        weights, experts = self._route(moe, x)
        routes.append(experts)
        w = weights.to(x.dtype)
        n, k = experts.shape
        num_experts = moe["gate_up"].shape[0]
        if n * k <= num_experts:
            gate, up = torch.einsum("nh,nkoh->nko", x, moe["gate_up"][experts]).chunk(2, dim=-1)
            y = torch.einsum("nki,nkhi->nkh", moe["act"](gate) * up, moe["down"][experts])
            return (y * w[..., None]).sum(1)
        dense = torch.zeros(n, num_experts, dtype=x.dtype, device=x.device).scatter_(1, experts, w)
        out = torch.zeros_like(x)
        for e in range(num_experts):
            gate, up = F.linear(x, moe["gate_up"][e]).chunk(2, dim=-1)
            out += F.linear(moe["act"](gate) * up, moe["down"][e]) * dense[:, e, None]
        return out

    def take_routes(self) -> torch.Tensor | None:
        """The experts each row of the last forward was routed to, (N, layers, k) int, or None (dense)."""
        routes, self._routes = self._routes, []
        return torch.stack(routes, dim=1) if routes else None

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """Routes of a static step, (N, layers, k) or None, for `take_routes`."""
        self._routes = [] if routes is None else list(routes.unbind(1))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(h, self.final_norm, self.eps)
        return self.lm_head(h).float()

    @torch.inference_mode()
    def prefill(
        self,
        prompts: list[list[int]],
        slots: list[int],
        adapters: list[Adapter | None] | None = None,
        images: list[ImagePrompt | None] | None = None,
    ) -> torch.Tensor:
        """Run positions [0, T_r) of each prompt r into `slots[r]`; return each one's last logits (R, V).
        `adapters[r]`: the LoRA adapter prompt r runs with (None: the base model); `images[r]`: its images
        (their tokens lead prompt r; the slot's rope offset is set for its decode steps).

        Every projection runs once over the tokens of all prompts together (one pass over the weights);
        attention runs per prompt, so prompts never see each other.
        """
        lens = [len(p) for p in prompts]
        self.ensure_capacity(max(lens))
        h = self._forward_prompts(prompts, slots, adapters, images)
        ends = torch.tensor(lens, device=self.device).cumsum(0)
        return self._logits(h[ends - 1])

    @torch.inference_mode()
    def score(
        self,
        prompts: list[list[int]],
        temperatures: list[float],
        images: list[ImagePrompt | None] | None = None,
    ) -> list[list[float]]:
        """Prefill-only scoring: for each prompt, log_softmax(logits / T)[token] of every token from
        position 1 on given the tokens before it (temperature 0 counts as 1, as in sampling). Nothing is
        cached: the running requests' slots are untouched. The base model (no adapter)."""
        return [lps for lps, _ in self.score_top(prompts, temperatures, 0, images)]

    @torch.inference_mode()
    def score_top(
        self,
        prompts: list[list[int]],
        temperatures: list[float],
        top_n: int,
        images: list[ImagePrompt | None] | None = None,
    ) -> list[tuple[list[float], list[list[tuple[float, int]]]]]:
        """`score`, and per prompt the `top_n` most likely (logprob, token id) of every position from 1
        on, most likely first (SGLang's `input_top_logprobs`; top_n >= the vocabulary: all of it)."""
        h = self._forward_prompts(prompts, None, None, images)
        out = []
        for part, prompt, temp in zip(h.split([len(p) for p in prompts]), prompts, temperatures, strict=True):
            logits = self._logits(part[:-1]) / (temp if temp > 0 else 1.0)
            targets = torch.tensor(prompt[1:], device=self.device)[:, None]
            lp = torch.log_softmax(logits, dim=-1)
            tops: list[list[tuple[float, int]]] = []
            if top_n > 0:
                top = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
                pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
                tops = [list(zip(v, i, strict=True)) for v, i in pairs]
            out.append((lp.gather(1, targets)[:, 0].tolist(), tops))
        return out

    def _forward_prompts(
        self,
        prompts: list[list[int]],
        slots: list[int] | None,
        adapters: list[Adapter | None] | None,
        images: list[ImagePrompt | None] | None = None,
    ) -> torch.Tensor:
        """Hidden states (N, hidden) of every position of every prompt (N = their total length), caching
        each prompt's k/v in its slot (`slots` None: no cache); `images[r]`: prompt r's images."""
        self._refresh_fused()
        self._routes = routes = []
        lens = [len(p) for p in prompts]
        self._set_groups(adapters, lens)
        ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        h = F.embedding(ids, self.embed)  # (N, hidden), N = sum of prompt lengths
        cos, sin = self.cos[positions], self.sin_signed[positions]
        if slots is not None:
            self.rope_offset[slots] = 0
        if images is not None and any(img is not None for img in images):
            self._add_images(h, cos, sin, lens, images, slots)
        for i, lw in enumerate(self.layers):
            x = _rms_norm(h, lw["norm_in"], self.eps)
            q, k, v = self._qkv(lw, x, cos, sin)  # (N, H|KVH, D)
            cache_slots = slots if slots is not None else [None] * len(prompts)
            parts = zip(q.split(lens), k.split(lens), v.split(lens), cache_slots, strict=True)
            attn = torch.cat([self._prefill_attention(i, slot, *qkv) for *qkv, slot in parts])
            h = h + self._proj(lw, "o", attn.reshape(ids.shape[0], -1))
            h = self._mlp(lw, h, routes)
        return h

    def _add_images(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lens: list[int],
        images: list[ImagePrompt | None],
        slots: list[int] | None,
    ) -> None:
        """In place over the rows of the prompts with images: image embeddings at their placeholder rows,
        M-RoPE cos/sin on every row; the slot's rope offset (the delta) for its decode steps."""
        if self.vision is None or self.mrope is None:
            raise ValueError(
                "this model has no vision tower: image_data is served for vision-language models"
            )
        start = 0
        for r, (n, image) in enumerate(zip(lens, images, strict=True)):
            if image is not None:
                for (a, b), emb in zip(image.runs, self.vision.embeddings(image), strict=True):
                    h[start + a : start + b] = emb.to(h.dtype)
                pos3, delta = mrope_positions(n, image, self.merge)
                cos[start : start + n], sin[start : start + n] = self.mrope.cos_sin(
                    pos3, self.cos, self.sin_signed
                )
                if slots is not None:
                    self.rope_offset[slots[r]] = delta
            start += n

    def _prefill_attention(self, layer: int, slot: int | None, q, k, v) -> torch.Tensor:
        """Causal attention of one prompt (T, H|KVH, D), caching its k/v in `slot` (None: not cached);
        -> (T, H, D)."""
        t = q.shape[0]
        if slot is not None:
            self.k_cache[layer][slot, :, :t] = k.transpose(0, 1)
            self.v_cache[layer][slot, :, :t] = v.transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
            scale=self.scale,
        )  # (1, H, T, D)
        return attn[0].transpose(0, 1)

    def prepare_decode(self, length: int, adapters: list[Adapter | None] | None, batch: int) -> None:
        """Before a decode step of `batch` rows up to `length` positions: derived weights current, the
        adapters' rows set, the cache long enough (a growth bumps `cache_generation`)."""
        self._refresh_fused()
        self._routes = []
        self._set_groups(adapters, [1] * batch)
        self.ensure_capacity(length)

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        length: int,
        adapters: list[Adapter | None] | None = None,
    ) -> torch.Tensor:
        """One eager step for slots 0..B-1: token_ids/positions (B,), length = max(positions) + 1 -> (B, V);
        `adapters[b]`: the LoRA adapter of row b (None: the base model)."""
        self.prepare_decode(length, adapters, token_ids.shape[0])
        logits, self._routes = self._decode_forward(token_ids, positions, length, static=False)
        return logits

    def decode_rows(
        self, ids: list[int], positions: list[int], adapters: list[Adapter | None] | None = None
    ) -> torch.Tensor:
        """One step for slots 0..B-1 by the configured path -> logits (B, V): the static decoder, or the
        eager `decode` when it is off (`decode_step = "eager"`) or a row runs a LoRA adapter."""
        if self.static is not None and not (adapters and any(a is not None for a in adapters)):
            return self.static(ids, positions)
        ids_t = torch.tensor(ids, device=self.device)
        return self.decode(ids_t, torch.tensor(positions, device=self.device), max(positions) + 1, adapters)

    def static_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static step (`StaticDecoder`): (logits (N, V), routes (N, layers, k) or None) of rows
        `ids`/`positions` (N,) attending to cache positions [0, span); no host sync, no value-dependent
        shape, no Python state changed (a CUDA graph replays it without running this code)."""
        logits, routes = self._decode_forward(ids, positions, span, static=True)
        return logits, torch.stack(routes, dim=1) if routes else None

    def _decode_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, span: int, *, static: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, V) of one step over slots 0..B-1 (B = len(token_ids)), writing each row's k/v at its
        position and attending to cache positions [0, span) masked to [0, positions[b]]; the experts
        chosen per layer (MoE). `static`: MoE experts by `_experts_static` (no host sync)."""
        b = token_ids.shape[0]
        h = F.embedding(token_ids, self.embed)  # (B, hidden)
        rope = positions if self.vision is None else (positions + self.rope_offset[:b]).clamp(min=0)
        cos, sin = self.cos[rope], self.sin_signed[rope]
        rows = torch.arange(b, device=self.device)
        visible = torch.arange(span, device=self.device)[None] <= positions[:, None]
        # additive float mask built once per step (a bool mask is converted again in every layer)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None]  # (B, 1, 1, L) over (B, KVH, G, L)
        routes: list[torch.Tensor] = []
        for i, lw in enumerate(self.layers):
            x = _rms_norm(h, lw["norm_in"], self.eps)
            q, k, v = self._qkv(lw, x, cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            # one query per row: two batched matmuls beat SDPA's CPU flash kernel (built for long queries);
            # query heads grouped per kv head (B, KVH, G, D), as HF's repeat_kv pairs them
            q_g = q.reshape(b, self.num_kv_heads, -1, self.head_dim) * self.scale
            scores = torch.matmul(q_g, kc[:b, :, :span].transpose(-1, -2)) + mask  # (B, KVH, G, L)
            attn = torch.matmul(scores.softmax(-1), vc[:b, :, :span])  # (B, KVH, G, D)
            h = h + self._proj(lw, "o", attn.reshape(b, -1))
            h = self._mlp(lw, h, routes, static)
        return self._logits(h), routes
