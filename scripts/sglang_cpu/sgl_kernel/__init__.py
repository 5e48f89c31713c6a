"""Stand-in for SGLang's `sgl_kernel` on machines where no CPU build of it can be installed.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`, torch-native attention and sampling)
imports one kernel from `sgl_kernel` on the paths our tests exercise: `assign_req_to_token_pool_cpu`,
written here in plain torch. Any other `*_cpu` kernel raises NotImplementedError when called (a test
that reaches one fails loudly); any other name is missing, so SGLang's own `ImportError` fallbacks apply.
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
