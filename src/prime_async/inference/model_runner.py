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
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # hand-written: F.rms_norm on CPU decomposes into ~10 ops with dtype round trips (slower here);
    # weight None: the gain is folded into the next projection
    xf = x.float() if x.dtype != torch.float32 else x
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if weight is None else weight * out


def _joint_norm_weight(att, num_heads: int, num_kv_heads: int) -> torch.Tensor | None:
    """q_norm / k_norm weights (Qwen3) stacked per head: (H + KVH, D), or None without qk-norm."""
    if getattr(att, "q_norm", None) is None:
        return None
    q_w, k_w = att.q_norm.weight, att.k_norm.weight
    return torch.cat([q_w.expand(num_heads, -1), k_w.expand(num_kv_heads, -1)])


class ModelRunner:
    """Owns the model weights (plus fused copies for speed) and the KV cache."""

    def __init__(self, *, model_path: str, dtype: str, device: str, num_slots: int, max_len: int, chunk: int):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
        if torch_dtype is None:  # auto
            torch_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(self.device).eval()
        )
        cfg = self.model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {cfg.model_type!r} unsupported by the torch engine: use sglang")
        self.dtype = torch_dtype
        self.vocab_size = int(cfg.vocab_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.num_slots, self.max_len, self.chunk = num_slots, max_len, chunk
        self._build_rope_table()
        self._fuse_weights()
        self.capacity = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.ensure_capacity(min(chunk, max_len))

    # ---- weights -------------------------------------------------------------------------------------
    def _build_rope_table(self) -> None:
        """cos/sin for every position once (rope scaling included, via the model's rotary module)."""
        pos = torch.arange(self.max_len, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.model.model.rotary_emb(probe, pos)
        self.cos, self.sin = cos[0], sin[0]  # (max_len, head_dim)
        half = self.head_dim // 2
        eye = torch.eye(half, device=self.device, dtype=self.dtype)
        self.rot = torch.zeros(self.head_dim, self.head_dim, device=self.device, dtype=self.dtype)
        self.rot[half:, :half] = -eye  # x @ rot == cat(-x2, x1) == rotate_half(x)
        self.rot[:half, half:] = eye

    @torch.no_grad()
    def _fuse_weights(self) -> None:
        """Derived weights for fewer ops per step (rebuilt after every weight load).

        q/k/v and gate/up are concatenated; RMSNorm gains are folded into the next projection
        (`W @ (g * x) == (W * g) @ x`); the attention scale 1/sqrt(D) is folded into the q rows (or the
        q-norm gain), which commutes with RoPE because RoPE is linear.
        """
        self.layers = []
        h, d = self.num_heads, self.head_dim
        for layer in self.model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
            qkv_b = None
            if att.q_proj.bias is not None:
                qkv_b = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
            qk_norm = _joint_norm_weight(att, h, self.num_kv_heads)
            if qk_norm is not None:
                qk_norm[:h] *= self.scale
            else:
                qkv[: h * d] *= self.scale
                if qkv_b is not None:
                    qkv_b[: h * d] *= self.scale
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self.layers.append(
                {
                    "qkv": qkv * layer.input_layernorm.weight[None],
                    "qkv_b": qkv_b,
                    "o": att.o_proj.weight,
                    "o_b": att.o_proj.bias,
                    "qk_norm": qk_norm,
                    "gate_up": gate_up * layer.post_attention_layernorm.weight[None],
                    "down": mlp.down_proj.weight,
                    "act": mlp.act_fn,
                }
            )
        self.embed = self.model.model.embed_tokens.weight
        self.lm_head = self.model.get_output_embeddings().weight * self.model.model.norm.weight[None]

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
        expected = self.expected_tensors()
        known = set(self.model.state_dict().keys())
        missing = sorted(set(expected) - set(state))
        unknown = sorted(set(state) - known)
        if missing or unknown:
            raise ValueError(f"weights in {model_path}: missing {missing[:5]}, unknown {unknown[:5]}")
        params = dict(self.model.named_parameters())
        for name, t in state.items():
            ref = params.get(name)
            want = expected.get(name) or tuple(self.model.state_dict()[name].shape)
            if tuple(t.shape) != want:
                raise ValueError(
                    f"weights in {model_path}: {name} has shape {tuple(t.shape)}, expected {want}"
                )
            if ref is not None and not t.is_floating_point():
                raise ValueError(f"weights in {model_path}: {name} has non-float dtype {t.dtype}")
        for name, p in params.items():
            p.copy_(state[name].to(device=self.device, dtype=p.dtype))
        self._fuse_weights()
        return len(params)

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

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst` (compaction).

        Inference mode: the cache tensors are created inside the inference-mode forward, and an in-place
        write to an inference tensor outside inference mode raises (compaction also runs on abort/pause).
        """
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    @torch.inference_mode()
    def free_cache(self) -> None:
        """Drop the cache back to one chunk (used by flush when nothing holds KV)."""
        self.capacity = 0
        self.k_cache, self.v_cache = [], []
        self.ensure_capacity(min(self.chunk, self.max_len))

    # ---- forward -------------------------------------------------------------------------------------
    def _qkv(self, lw: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (N, hidden) -> q (N, H, D), k/v (N, KVH, D) with q/k-norm and RoPE applied."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, lw["qkv"], lw["qkv_b"])
        # q and k heads side by side (N, H + KVH, D): one norm and one RoPE for both (fewer CPU ops)
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk, v = qk.reshape(-1, h + kvh, d), v.view(-1, kvh, d)
        if lw["qk_norm"] is not None:
            qk = _rms_norm(qk, lw["qk_norm"], self.eps)
        qk = qk * cos[:, None] + (qk @ self.rot) * sin[:, None]  # rotate_half as a (D, D) matmul
        return qk[:, :h], qk[:, h:], v

    def _mlp(self, lw: dict, h: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(h, None, self.eps)
        gate, up = F.linear(x, lw["gate_up"]).chunk(2, dim=-1)
        return h + F.linear(lw["act"](gate) * up, lw["down"])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(h, None, self.eps)
        return F.linear(h, self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], slot: int) -> torch.Tensor:
        """Run positions [0, T) of one request into `slot`; return the last position's logits (V,)."""
        t = len(token_ids)
        self.ensure_capacity(t)
        ids = torch.tensor(token_ids, device=self.device)
        h = F.embedding(ids, self.embed)  # (T, hidden)
        cos, sin = self.cos[:t], self.sin[:t]
        for i, lw in enumerate(self.layers):
            x = _rms_norm(h, None, self.eps)
            q, k, v = self._qkv(lw, x, cos, sin)  # (T, H|KVH, D)
            self.k_cache[i][slot, :, :t] = k.transpose(0, 1)
            self.v_cache[i][slot, :, :t] = v.transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
                scale=1.0,  # 1/sqrt(D) is folded into q
            )  # (1, H, T, D)
            h = h + F.linear(attn[0].transpose(0, 1).reshape(t, -1), lw["o"], lw["o_b"])
            h = self._mlp(lw, h)
        return self._logits(h[-1:])[0]

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """One step for slots 0..B-1: token_ids/positions (B,), length = max(positions) + 1 -> (B, V)."""
        b = token_ids.shape[0]
        self.ensure_capacity(length)
        h = F.embedding(token_ids, self.embed)  # (B, hidden)
        cos, sin = self.cos[positions], self.sin[positions]
        rows = torch.arange(b, device=self.device)
        visible = torch.arange(length, device=self.device)[None] <= positions[:, None]
        # additive float mask built once per step (a bool mask is converted again in every layer)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None]  # (B, 1, 1, L) over (B, KVH, G, L)
        for i, lw in enumerate(self.layers):
            x = _rms_norm(h, None, self.eps)
            q, k, v = self._qkv(lw, x, cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[rows, :, positions] = k
            vc[rows, :, positions] = v
            # one query per row: two batched matmuls beat SDPA's CPU flash kernel (built for long queries);
            # query heads grouped per kv head (B, KVH, G, D), as HF's repeat_kv pairs them
            q_g = q.reshape(b, self.num_kv_heads, -1, self.head_dim)  # scale folded into q
            scores = torch.matmul(q_g, kc[:b, :, :length].transpose(-1, -2)) + mask  # (B, KVH, G, L)
            attn = torch.matmul(scores.softmax(-1), vc[:b, :, :length])  # (B, KVH, G, D)
            h = h + F.linear(attn.reshape(b, -1), lw["o"], lw["o_b"])
            h = self._mlp(lw, h)
        return self._logits(h)
