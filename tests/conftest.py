"""Shared fixtures: the tiny offline model is built once per test run (all xdist workers share it).

The suite runs on parallel xdist workers (`-n` in pyproject's addopts): most tests wait on processes,
HTTP or ZeroMQ part of the time, so two cores stay busy with more than one test at a time. Tests that
must not overlap with others of their kind share an `xdist_group` (the matrix, whose cells run on a
pool of their own; real SGLang servers; runs that hold the default ports).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from device_marks import cuda_device_count, device_skip_reason
from shared_builds import built_once

# With PYTHONDONTWRITEBYTECODE=1 (common in CI images) Python never writes .pyc files, so every process
# a test starts (a run starts three or four) compiled torch, transformers and verifiers from source again:
# ~9 s of CPU each, the largest single cost of the suite. The processes the tests start write and reuse
# the bytecode cache instead (a tiny `rl` run then needs 2.4x less CPU).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


# Files that start first, longest first (seconds on one xdist worker of a 2-core machine, measured with
# `--durations`): with `--dist loadfile --no-loadscope-reorder` each idle worker takes the next file in
# this order, so the long files never start last and stretch the run. The matrix runs its cells on a
# pool of its own and keeps its worker busy for most of the suite. The third SGLang file is left out on
# purpose: three SGLang start-ups at once took 217 s for the distributed one (100 s when it starts alone).
FIRST = (
    "tests/matrix/test_matrix.py",  # ~730 in all, on its own pool
    "tests/launcher/test_sglang_cpu.py",  # ~200: a real SGLang server, 1-3 min start-up
    "tests/launcher/test_lifecycle.py",  # ~190
    "tests/orchestrator/test_distributed_rl.py",  # ~190
    "tests/orchestrator/test_env_kinds_rl.py",  # ~190
    "tests/reliability/test_faults.py",  # ~240 (the trainer kill on both backends)
    "tests/megatron/test_megatron_backend.py",  # ~150
    "tests/environments/test_tool_env.py",  # ~150
    "tests/megatron/test_megatron_checkpoint.py",  # ~60
    "tests/models/test_smollm2.py",  # ~130 (the conversion other tests wait for)
    "tests/orchestrator/test_lora_rl.py",  # ~120
    "tests/environments/test_episodes.py",  # ~100
    "tests/trainer/test_trainer_process.py",  # ~100
    "tests/inference/test_conformance.py",  # ~80
    "tests/doctor/test_doctor_cli.py",  # ~80 (an engine, the trainer model, a K = 0 rl run)
    "tests/orchestrator/test_integration.py",  # ~75
    "tests/orchestrator/test_deterministic.py",  # ~75
    "tests/orchestrator/test_mix_eval_rl.py",  # ~70
)


def pytest_configure(config: pytest.Config) -> None:
    # `@pytest.mark.needs_devices(n)`: a test starting n trainer ranks; skipped, naming both counts, when
    # CUDA is visible with fewer than n devices (`device_marks.py`)
    config.addinivalue_line("markers", "needs_devices(n): n trainer ranks, one CUDA device each (on CUDA)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))  # stable: order kept
    visible = cuda_device_count()
    for item in items:
        marker = item.get_closest_marker("needs_devices")
        reason = device_skip_reason(marker.args[0], visible) if marker is not None else None
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
    if visible > 0:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny random Qwen3-style model + ChatML tokenizer (HF format, safetensors)."""
    from prime_async.models.tiny import build_tiny_model

    return built_once(tmp_path_factory, "tiny_model", build_tiny_model)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny random Qwen3-MoE model (4 experts, top-2) with the tiny model's tokenizer."""
    from prime_async.models.tiny import build_tiny_moe_model

    return built_once(tmp_path_factory, "tiny_moe_model", build_tiny_moe_model)


@pytest.fixture(scope="session")
def tiny_vlm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the tiny random Qwen2.5-VL-style model + processor (`models/tiny_vlm.py`)."""
    from prime_async.models.tiny_vlm import build_tiny_vlm

    return built_once(tmp_path_factory, "tiny_vlm_model", build_tiny_vlm)


@pytest.fixture(autouse=True)
def _fresh_renderers_lock() -> None:
    """`renderers.client` keeps a module-level asyncio.Lock that binds to the first event loop that
    contends it; a later test's event loop then fails with "bound to a different event loop". A real
    process runs one loop, so only the test session needs a fresh lock per test."""
    module = sys.modules.get("renderers.client")
    if module is not None and hasattr(module, "_max_prompt_len_lock"):
        module._max_prompt_len_lock = asyncio.Lock()
