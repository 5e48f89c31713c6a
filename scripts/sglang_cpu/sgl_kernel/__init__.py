"""Stand-in for SGLang's `sgl_kernel` on machines where no CPU build of it can be installed.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`, torch-native attention and sampling)
imports one kernel from `sgl_kernel` on the paths our tests exercise: `assign_req_to_token_pool_cpu`,
written here in plain torch. Any other `*_cpu` kernel raises NotImplementedError when called (a test
that reaches one fails loudly); any other name is missing, so SGLang's own `ImportError` fallbacks apply.
The `torch.ops.sgl_kernel.*_cpu` operators some model modules bind at import time (`_IMPORT_TIME_OPS`:
the Qwen-VL processor imports those modules) are registered the same way: they raise when called.
Put this directory first on PYTHONPATH to run real SGLang on a CPU-only machine (docs/lifecycle.md:
"Real SGLang on CPU"; `tests/launcher/test_sglang_cpu.py` does).
"""

from __future__ import annotations

from typing import Any

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """`req_to_token[req, start:end] = out_cache_loc[next end - start slots]`, request by request."""
    position = 0
    for i in range(req_pool_indices.numel()):
        start, end = int(start_offset[i]), int(end_offset[i])
        assert end <= max_context_len, f"request {i}: end {end} > context {max_context_len}"
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[position : position + end - start]
        position += end - start


def __getattr__(name: str) -> Any:
    if name.endswith("_cpu"):

        def missing(*_args: Any, **_kwargs: Any) -> Any:
            raise NotImplementedError(f"stand-in sgl_kernel has no {name}")

        return missing
    raise AttributeError(name)


# Kernels some SGLang model modules bind at import time as `torch.ops.sgl_kernel.<name>` when running on
# CPU (qwen3_5, cosmos3, interns2*: imported by the Qwen-VL multimodal processor, so a Qwen2.5-VL model
# cannot be served without them). Registered as operators that raise when called: a model that would
# use one fails loudly; the others import.
_IMPORT_TIME_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_input_proj_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
_library = torch.library.Library("sgl_kernel", "FRAGMENT")


def _register_missing(name: str) -> None:
    def missing(args: list[torch.Tensor]) -> None:
        raise NotImplementedError(f"stand-in sgl_kernel has no {name}")

    _library.define(f"{name}(Tensor[] args) -> ()")
    _library.impl(name, missing, "CompositeExplicitAutograd")


for _name in _IMPORT_TIME_OPS:
    _register_missing(_name)
