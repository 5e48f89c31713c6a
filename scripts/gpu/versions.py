"""One line of versions for scripts/gpu_check.sh: torch, CUDA, devices, NCCL, transformers, megatron-core,
sglang, and where prime_async was imported from.

    python scripts/gpu/versions.py [--cuda]

Exit status 1 when a required import fails (torch, transformers, prime_async) or, with `--cuda`, when no
CUDA device is visible; the optional ones (megatron-core, sglang) print "-" when absent.
"""

from __future__ import annotations

import importlib
import sys


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an optional package may fail in many ways (missing CUDA libs, ...)
        return f"- ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "?"))


def describe(require_cuda: bool) -> tuple[str, bool]:
    """(the line, all required parts present)."""
    import torch
    import transformers

    import prime_async

    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    ok = True
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        parts += [
            f"CUDA {torch.version.cuda}",
            f"{torch.cuda.device_count()}x {', '.join(names)}",
            f"NCCL {nccl}",
        ]
    else:
        parts.append("no CUDA device")
        ok = not require_cuda
    parts += [
        f"transformers {transformers.__version__}",
        f"megatron-core {_version('megatron.core')}",
        f"sglang {_version('sglang')}",
        f"prime_async from {prime_async.__file__.rsplit('/', 2)[0]}",
    ]
    return " | ".join(parts), ok


def main() -> int:
    line, ok = describe(require_cuda="--cuda" in sys.argv[1:])
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
