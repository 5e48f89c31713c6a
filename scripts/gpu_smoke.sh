#!/usr/bin/env bash
# Run the inference conformance suite against real SGLang on a GPU machine, in one go.
#   bash scripts/gpu_smoke.sh                     # installs the sglang extra, launches SGLang itself
#   PRIME_ASYNC_SGLANG_URL=http://127.0.0.1:30000 PRIME_ASYNC_SGLANG_MODEL=/path/to/model \
#     bash scripts/gpu_smoke.sh                   # against an already running server (float32 weights)
# Extra SGLang flags for the self-launched server: PRIME_ASYNC_SGLANG_ARGS (default in tests/inference/conftest.py;
# the tiny test model has head_dim 32, which some attention kernels reject).
# Exit status is pytest's. The embedded-engine half runs too, as a reference on the same machine.
# Weights over torch.distributed: NCCL from the test process / trainer rank 0 into a CUDA embedded engine
# and into real SGLang (`rl` with weights.transport = "distributed").
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" 2>/dev/null \
  || uv run python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')"
uv sync --extra sglang
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
uv run python -c "import sglang; print('sglang', sglang.__version__)"
# tests/inference includes the weight-group tests (gloo on CPU, NCCL into a CUDA embedded engine); the second
# file runs `rl` with weights.transport = "distributed" against real SGLang on CUDA with NCCL.
exec uv run pytest tests/inference tests/launcher/test_sglang_distributed.py::test_rl_distributed_on_real_sglang_gpu_nccl \
  -q -rs --timeout 1200 "$@"

# Megatron trainer backend (issue 8): `bash scripts/gpu_smoke_megatron.sh` (installs the `megatron` extra,
# runs tests/megatron on the GPU with NCCL, then the CPU-shim suite). It cannot run from here: the `exec`
# above ends this script. To check both in one go, drop that `exec` and call it on the next line.
