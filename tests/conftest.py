"""Shared fixtures: the tiny offline model is built once per test session."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny random Qwen3-style model + ChatML tokenizer (HF format, safetensors)."""
    from prime_async.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(autouse=True)
def _fresh_renderers_lock() -> None:
    """`renderers.client` keeps a module-level asyncio.Lock that binds to the first event loop that
    contends it; a later test's event loop then fails with "bound to a different event loop". A real
    process runs one loop, so only the test session needs a fresh lock per test."""
    module = sys.modules.get("renderers.client")
    if module is not None and hasattr(module, "_max_prompt_len_lock"):
        module._max_prompt_len_lock = asyncio.Lock()
