#!/usr/bin/env bash
# Run `doctor` on every environment under environments/, each with the config it trains with here (the
# tiny model for the tiny configs' envs, SmolLM2 for echo-text, lookup-agent and echo-long). The K = 0 run
# is done once per model (reverse-text, echo-text); the other envs skip it. Prints each env's table.
#   bash scripts/doctor_environments.sh [output_root]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-outputs/doctor}
run() { local name=$1; shift; echo "=== $name: doctor $*"; uv run doctor "$@" --output_dir "$out/$name" 2>&1 \
  | grep -v "INFO\|Loading weights\|Writing model"; echo "=== $name: exit ${PIPESTATUS[0]}"; }
run reverse-text @ configs/tiny/rl.toml
run calculator @ configs/tiny/rl.toml --env calculator --sync-steps 0
run calculator-tools @ configs/tiny/rl.toml --env calculator-tools --seq_len 1024 \
  --orchestrator.sampling.max_tokens 24 --sync-steps 0
run word-chain @ configs/tiny/rl.toml --env word-chain --seq_len 512 --sync-steps 0
run higher-lower @ environments/higher_lower/rl_tiny.toml --sync-steps 0
run echo-text @ configs/echo_text/rl.toml
run lookup-agent @ configs/lookup_agent/rl.toml --sync-steps 0
run echo-long @ configs/echo_long/rl.toml --sync-steps 0
