#!/usr/bin/env bash
# Full soak: 50+ steps of the tiny config per pause mode, each component SIGKILLed once and restarted by
# `rl` (inference with the newest STABLE weights, trainer/orchestrator with resume). Afterwards the test
# checks that the ledger balanced at every step, no trained group exceeded K, the buffer stayed bounded and
# no prompt was skipped or trained twice (tests/reliability/test_faults.py; CI runs it with 14 steps).
#   scripts/soak.sh                 # 50 steps, retract + in_place + drain
#   SOAK_STEPS=80 SOAK_MODES="drain" scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${SOAK_STEPS:-50}"
modes="${SOAK_MODES:-retract in_place drain}"
status=0
for mode in $modes; do
  echo "=== soak: ${steps} steps, pause mode ${mode}"
  SOAK_STEPS="$steps" SOAK_PAUSE_MODE="$mode" SOAK_TIMEOUT_S="${SOAK_TIMEOUT_S:-3000}" \
    uv run pytest tests/reliability/test_faults.py -x -q -s -p no:cacheprovider --timeout 3600 || status=1
done
exit "$status"
