#!/usr/bin/env bash
# Run the inference conformance suite against real SGLang on a GPU machine, in one go.
#   bash scripts/gpu_smoke.sh                     # installs the sglang extra, launches SGLang itself
#   PRIME_ASYNC_SGLANG_URL=http://127.0.0.1:30000 PRIME_ASYNC_SGLANG_MODEL=/path/to/model \
#     bash scripts/gpu_smoke.sh                   # against an already running server (float32 weights)
# Extra SGLang flags for the self-launched server: PRIME_ASYNC_SGLANG_ARGS (default in tests/inference/conftest.py;
# the tiny test model has head_dim 32, which some attention kernels reject).
# Exit status is pytest's. The embedded-engine half runs too, as a reference on the same machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" 2>/dev/null \
  || uv run python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"
uv sync --extra sglang
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
uv run python -c "import sglang; print('sglang', sglang.__version__)"
exec uv run pytest tests/inference -q -rs --timeout 1200 "$@"

# Megatron trainer backend (issue 8): `bash scripts/gpu_smoke_megatron.sh` (installs the `megatron` extra,
# runs tests/megatron on the GPU with NCCL, then the CPU-shim suite). It cannot run from here: the `exec`
# above ends this script. To check both in one go, drop that `exec` and call it on the next line.
