#!/usr/bin/env bash
# GPU smoke check of the megatron trainer backend (issue 8). Run on a machine with >= 1 CUDA GPU:
#   bash scripts/gpu_smoke_megatron.sh
# 1. installs the `megatron` extra into the project venv (inexact: nothing else is removed);
# 2. runs the `gpu`-marked megatron test (NCCL, no CPU shim; TP=2 when two GPUs are visible): logits of the
#    tiny Qwen3 model vs HF, one train step with the shared loss, export of HF weights;
# 3. runs the CPU-shim suite too, as a regression check of the same code on this machine.
# Exit status is non-zero on any failure. Takes ~3-5 minutes (mostly imports and the tiny model build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v uv >/dev/null || pip install uv
uv sync --all-groups --extra megatron --inexact
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
echo "== megatron backend on GPU =="
uv run pytest tests/megatron/test_megatron_gpu.py -m gpu -x -q -p no:cacheprovider
echo "== megatron backend, CPU-shim suite =="
CUDA_VISIBLE_DEVICES="" uv run pytest tests/megatron -x -q -p no:cacheprovider
