"""`hide_unloadable_kernels`: a kernel package whose import raises OSError looks absent afterwards.

The fake packages are real files on `sys.path`; the last test is the real case (flash_mla from the sglang
extra next to megatron-core on a machine without the CUDA driver), run where both are installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prime_async.trainer.megatron.cuda_kernels import hide_unloadable_kernels

FAKES = {
    "fake_cuda_kernel": "raise OSError('libcuda.so.1: cannot open shared object file')\n",
    "fake_fine_kernel": "VALUE = 7\n",
}


@pytest.fixture
def fake_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, body in FAKES.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in FAKES:
        sys.modules.pop(name, None)


def _optional_import(name: str) -> bool:
    """What megatron-core does: `try: from name import ... except ImportError`."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def test_unloadable_kernel_becomes_absent_and_loadable_one_stays(fake_kernels: None) -> None:
    with pytest.raises(OSError, match="libcuda"):  # what breaks megatron-core without the guard
        _optional_import("fake_cuda_kernel")
    names = ("fake_cuda_kernel", "fake_fine_kernel", "fake_not_installed_kernel")
    assert hide_unloadable_kernels(names) == ["fake_cuda_kernel"]
    assert _optional_import("fake_cuda_kernel") is False
    assert sys.modules["fake_fine_kernel"].VALUE == 7
    assert "fake_not_installed_kernel" not in sys.modules
    assert hide_unloadable_kernels(names) == []  # idempotent: already decided


@pytest.mark.skipif(
    importlib.machinery.PathFinder.find_spec("flash_mla") is None  # on disk (sys.modules may hide it)
    or importlib.util.find_spec("megatron") is None
    or torch.cuda.is_available(),
    reason="needs the sglang and megatron extras on a machine without CUDA",
)
def test_megatron_model_imports_next_to_sglang_flash_mla() -> None:
    code = (
        "import prime_async.trainer.megatron.model, megatron.core.transformer.attention as a\n"
        "assert a.HAVE_FMLA is False\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
