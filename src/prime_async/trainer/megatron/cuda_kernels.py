"""Make CUDA-only kernel packages that are installed but cannot load here look absent to megatron-core.

Called once by `prime_async/trainer/megatron/__init__.py`, so it runs before any module of this package
imports megatron-core.

Why: megatron-core 0.16 imports the optional `flash_mla` (installed by the `sglang` extra) inside
`try: ... except ImportError` (`megatron/core/transformer/attention.py`). On a machine without the CUDA
driver, flash_mla's import raises OSError instead (its extension links `libcuda.so.1`), which megatron-core
does not catch, so importing `GPTModel` fails and the two extras could not share one environment.

Invariants: a listed package that imports cleanly stays imported (and is used, e.g. on GPU machines); one
whose import raises OSError is recorded as absent (`sys.modules[name] = None`), so every later import of it
raises ImportError, megatron-core's "not installed" path; a package that is not installed is left alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

CUDA_ONLY_KERNELS = ("flash_mla",)


def hide_unloadable_kernels(names: tuple[str, ...] = CUDA_ONLY_KERNELS) -> list[str]:
    """Import each installed package of `names`; hide (and return) those whose import raises OSError."""
    hidden = []
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except OSError as exc:
            sys.modules[name] = None  # type: ignore[assignment]  # marker: later imports raise ImportError
            hidden.append(name)
            logger.debug("%s is installed but cannot load here (%s); hidden from megatron-core", name, exc)
    return hidden
