"""`resolve_dtype`: the one rule for a model's parameter dtype (trainer backends and the torch engine)."""

from __future__ import annotations

import pytest
import torch

from prime_async.utils.dtypes import resolve_dtype


def test_auto_is_bfloat16_on_cuda_float32_elsewhere() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16  # no GPU needed: names only
    assert resolve_dtype("auto", "meta") == torch.float32


def test_named_dtypes_ignore_the_device() -> None:
    for device in ("cpu", "cuda"):
        assert resolve_dtype("float32", device) == torch.float32
        assert resolve_dtype("bfloat16", device) == torch.bfloat16


def test_unknown_name_is_one_clear_line() -> None:
    expected = r"unknown model dtype 'fp16': expected one of auto, float32, bfloat16"
    with pytest.raises(ValueError, match=expected):
        resolve_dtype("fp16", "cpu")
