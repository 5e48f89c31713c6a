#!/usr/bin/env bash
# The offline GPU check: on a machine with CUDA and torch but no network and no uv, install the project
# from a wheelhouse (scripts/gpu_wheelhouse.sh, built on a CPU machine) and run every GPU check in 6 minutes
# or less, each under a hard time limit; prints one table (check | result | seconds | detail).
#   bash scripts/gpu_check.sh --wheels DIR [--out DIR]      # from the checkout copied beside DIR
#   bash scripts/gpu_check.sh --dry-run                      # the checks, their limits and commands
#   bash scripts/gpu_check.sh --cpu [--only a,b]             # the same table, CPU-runnable checks on the CPU
# Options: --out DIR (default $OUT, else outputs/gpu_check): logs/<check>.log, table.md, the runs' logs and
#   metrics; --python PY (default python3, the image's); --budget S (default 360: the whole check; with
#   SGLang in the wheelhouse raise it to ~600, its conformance starts a server);
#   --only a,b (these checks); --timeout NAME=S (one check's limit, repeatable); --extra NAME=COMMAND (one
#   more check, run last with the benchmarks; limit 60 s unless --timeout NAME=S; repeatable).
# Install: `PY -m pip install --no-index --no-deps --target WORK/site DIR/whl/*.whl`, then
#   PYTHONPATH=<checkout>/src:WORK/site (the checkout's code first, the wheels for everything else).
# Phases: install and versions; then three lanes at once on the GPU(s): rl runs | conformance and MoE |
#   megatron; then the benchmarks alone. Each check runs under `timeout` (SIGINT, SIGKILL 10 s later) and
#   whatever it started is killed after it (found by an environment tag, even across setsid). A failing
#   check is marked FAIL with its log path and the others go on. Exit status: the number of FAIL rows.
# Big outputs (site, models, run directories) stay in WORK (${TMPDIR:-/tmp}/gpu_check_work); only logs,
#   metrics and the table go to --out.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 100
wheels="" out=${OUT:-} PY=python3 budget=360 mode=gpu dry=0 only=""
declare -A OVERRIDE=()
EXTRA=()
die() { echo "gpu_check: $*" >&2; exit 100; }
while [ $# -gt 0 ]; do
  case $1 in
    --wheels) wheels=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --python) PY=${2:?}; shift 2 ;;
    --budget) budget=${2:?}; shift 2 ;;
    --only) only=",${2:?},"; shift 2 ;;
    --timeout) [[ ${2:-} =~ ^[a-z_]+=[0-9]+$ ]] || die "--timeout wants NAME=SECONDS, got '${2:-}'"
               OVERRIDE[${2%%=*}]=${2#*=}; shift 2 ;;
    --extra) [[ ${2:-} =~ ^[a-z_]+=. ]] || die "--extra wants NAME=COMMAND, got '${2:-}'"
             EXTRA+=("$2"); shift 2 ;;
    --cpu) mode=cpu; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | grep '^#'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] || die "--budget wants seconds, got '$budget'"
[ -z "$wheels" ] || [ -d "$wheels" ] || die "--wheels $wheels: no such folder"
out=${out:-$REPO/outputs/gpu_check}
WORK=${TMPDIR:-/tmp}/gpu_check_work
SITE=$WORK/site
M036=$WORK/qwen3_036b  # the 0.36B Qwen3 shape of the first H200 run (hidden 1024, 28 layers, vocab 4096)
DEV=cuda BENCH_MODEL=$M036 TRAINER_SHAPE=qwen3-0.6b TRAINER_ROWS=4  # bench_trainer: 4 rows of 4096 tokens
[ "$mode" = cpu ] && DEV=cpu BENCH_MODEL=models/tiny TRAINER_SHAPE=tiny TRAINER_ROWS=2  # 0.36B: minutes on a CPU
RL="$PY -m prime_async.entrypoints.rl"
RL_PORTS="--inference.server.port 0 --transport.port 0"
PYTEST="$PY -m pytest -p no:cacheprovider -p no:randomly -o addopts= -q -rfEs -n 0"

# ---- the checks: NAME LANE LIMIT_S WHEN COMMAND -------------------------------------------------------
# LANE: 0 first, alone | a, b, c at once | z last, alone. WHEN: always | gpu (skipped with --cpu) |
# sglang (skipped unless importable) | gpus2 (2+ CUDA devices; on --cpu the ranks use gloo).
NAMES=()
declare -A LANE LIMIT WHEN CMD
add() { NAMES+=("$1"); LANE[$1]=$2; LIMIT[$1]=$3; WHEN[$1]=$4; CMD[$1]=$5; }
add install 0 60 always "install_wheels"
add models 0 60 always "build_models"  # before the lanes: two runs of one config must not build it at once
add versions 0 90 always "$PY scripts/gpu/versions.py $([ "$mode" = gpu ] && echo --cuda)"
rl_run() {  # rl_run NAME STEPS ARGS...: a tiny rl, then one line of its metrics
  local name=$1 steps=$2; shift 2
  echo "$RL @ configs/tiny/rl.toml --max-steps $steps --output-dir $WORK/$name $RL_PORTS $* &&" \
    "$PY scripts/gpu/run_summary.py $WORK/$name --steps $steps"
}
add rl_filesystem a 90 always "$(rl_run rl_filesystem 8 --weights.transport filesystem)"
# the shared-device weight path (weights/shared_memory.py: CUDA IPC on a GPU, POSIX shared memory on --cpu);
# stated explicitly, with the device shares it requires, so that it also runs on the CPU
add rl_shared a 90 always "$(rl_run rl_shared 8 --weights.transport shared --trainer.mem-fraction 0.5 \
  --inference.engine.mem-fraction 0.4)"
add rl_distributed a 90 gpus2 "$(rl_run rl_distributed 8 --weights.transport distributed --weights.master-port 0)"
# the shared-device path into a real engine, compared bit for bit with filesystem (CUDA IPC on a GPU)
add shared_weights a 60 always "$PYTEST --timeout 55 tests/inference/test_distributed_weights.py -m 'gpu or not gpu' -k shared"
# the embedded engine's static decode step and its CUDA graphs (inference.engine.decode_step = auto: graphs on CUDA)
add static_decode a 60 always "$PYTEST --timeout 55 tests/inference/test_static_decode.py -m 'gpu or not gpu'"
add conformance b 150 always "$PYTEST --timeout 140 tests/inference/test_conformance.py -m 'gpu or not gpu' -k embedded"
add conformance_sglang b 150 sglang "$PYTEST --timeout 140 tests/inference/test_conformance.py -m 'gpu or not gpu' -k sglang"
add moe_replay b 90 always "$RL @ configs/tiny/rl_moe.toml --max-steps 6 --output-dir $WORK/moe_replay $RL_PORTS \
--router-replay true --model.dtype bfloat16 && $PY scripts/gpu/run_summary.py $WORK/moe_replay --steps 6 \
--require moe/routing_agreement"
add router_replay_tests b 60 always "$PYTEST --timeout 50 tests/trainer/test_router_replay.py"
add megatron_gpu c 120 gpu "$PYTEST --timeout 110 tests/megatron/test_megatron_gpu.py -m 'gpu or not gpu'"
add megatron_rl_ckpt c 100 always "$RL @ configs/tiny/rl.toml --max-steps 4 --output-dir $WORK/megatron_rl_ckpt $RL_PORTS \
--trainer.backend megatron --trainer.ckpt.interval 3 && test -f $WORK/megatron_rl_ckpt/checkpoints/trainer/step_3/COMPLETE \
&& echo -n 'checkpoint step_3 COMPLETE; ' && $PY scripts/gpu/run_summary.py $WORK/megatron_rl_ckpt --steps 4"
add megatron_tests c 200 always "$PYTEST --timeout 190 tests/megatron/test_megatron_backend.py tests/megatron/test_megatron_checkpoint.py -m 'gpu or not gpu'"
# eager beside the default decode step (graphs on CUDA, static on --cpu), fp32 then bf16
add bench_engine z 50 always "$PY scripts/bench_engine.py --model-dir $BENCH_MODEL --device $DEV --batches 1 8 \
--new-tokens 32 --repeats 1 --kernels dense --decode-steps eager auto --dtype float32"
add bench_engine_bf16 z 50 always "$PY scripts/bench_engine.py --model-dir $BENCH_MODEL --device $DEV --batches 1 8 \
--new-tokens 32 --repeats 1 --kernels dense --decode-steps eager auto --dtype bfloat16"
add bench_trainer z 60 always "$PY scripts/bench_trainer.py --device $DEV --shape $TRAINER_SHAPE --backends fsdp megatron \
--steps 2 --rows $TRAINER_ROWS"
for e in "${EXTRA[@]}"; do add "${e%%=*}" z 60 always "${e#*=}"; done

# ---- helpers run inside a check's shell (exported) ------------------------------------------------------
install_wheels() {
  local files=() d
  shopt -s nullglob
  for d in "$WHEELS/whl" "$WHEELS"; do [ -d "$d" ] && files+=("$d"/*.whl); done
  [ -e "${files[0]:-}" ] || { echo "no *.whl in $WHEELS or $WHEELS/whl"; return 1; }
  "$PY" -m pip --version >/dev/null 2>&1 || { echo "no pip in $PY: the image's python must have pip"; return 1; }
  rm -rf "$SITE" && mkdir -p "$SITE"
  "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check -q \
    --target "$SITE" "${files[@]}" || return 1
  echo "${#files[@]} wheels into $SITE"
}
build_models() {  # the configs' tiny models (where rl would build them) and the 0.36B bench shape
  "$PY" - "$BENCH_MODEL" <<'PY'
import sys
from pathlib import Path
from prime_async.models.tiny import build_tiny_model, build_tiny_moe_model
bench = Path(sys.argv[1])
shape = dict(vocab_size=4096, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8)
jobs = [(Path("models/tiny"), build_tiny_model, {}), (Path("models/tiny-moe"), build_tiny_moe_model, {}),
        (bench, build_tiny_model, shape)]
jobs = jobs[:2] if bench == Path("models/tiny") else jobs
for path, build, shape in jobs:
    if not (path / "config.json").is_file():
        build(path, **shape)
print("ready:", ", ".join(str(path) for path, _, _ in jobs))
PY
}
export -f install_wheels build_models
export PY SITE WORK BENCH_MODEL WHEELS="$wheels"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled WANDB_SILENT=true PYTHONUNBUFFERED=1
[ "$mode" = cpu ] && export CUDA_VISIBLE_DEVICES=""

# ---- the runner -----------------------------------------------------------------------------------------
skip_reason() {  # why NAME does not run here ("" = it runs)
  local name=$1
  if [ -n "$only" ] && [[ $only != *",$name,"* ]]; then echo "not in --only"; return; fi
  case ${WHEN[$name]} in
    gpu) [ "$mode" = cpu ] && echo "GPU only (--cpu)" ;;
    sglang) "$PY" -c "import sglang" >/dev/null 2>&1 || echo "sglang not importable (wheelhouse built without --sglang)" ;;
    gpus2) if [ "$mode" = gpu ]; then
             local n; n=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
             [ "${n:-0}" -ge 2 ] || echo "needs 2 CUDA devices, ${n:-0} visible"
           fi ;;
  esac
  [ "$name" = install ] && [ -z "$wheels" ] && echo "no --wheels: the current python's packages"
}

kill_tagged() {  # every process still carrying GPU_CHECK_TAG=$1 or $1.* (a check's descendants, setsid or not)
  local tag=$1 p pids=()
  for p in /proc/[0-9]*; do
    grep -qzxE "GPU_CHECK_TAG=$tag(\..*)?" "$p/environ" 2>/dev/null && pids+=("${p#/proc/}")
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null; sleep 3; kill -KILL "${pids[@]}" 2>/dev/null
  echo "killed ${#pids[@]} leftover process(es) of the check: ${pids[*]}"
}

detail_of() {  # DETAIL of check $2 from its log $1: bench_engine's tokens/s by batch, pytest's summary,
  local log=$1 line  # else the last non-empty line; at most 110 characters
  if [[ "${2:-}" == bench_engine* ]]; then  # "batch  generate  dense  packed  dense/gen ..." rows: the tok/s
    line=$(awk '/^batch / { h = $2; for (i = 3; i <= NF && $i !~ /\//; i++) h = h "/" $i }
                /^ +[0-9]+ +[0-9.]+ / { v = $2; for (i = 3; i <= NF && $i !~ /x$/; i++) v = v "/" $i
                                        s = s sep "b" $1 " " v; sep = ", " }
                END { if (s != "") print "tok/s " h ": " s }' "$log")
    [ -n "$line" ] && { echo "${line:0:110}"; return; }
  fi
  if [ "${2:-}" = bench_trainer ]; then  # "backend step s tokens/s TFLOP/s MFU" rows
    line=$(awk '$1 ~ /^(fsdp|megatron)$/ && NF >= 5 { s = s sep $1 " " $3 " tok/s MFU " $5; sep = ", " }
                END { if (s != "") print s }' "$log")
    [ -n "$line" ] && { echo "${line:0:110}"; return; }
  fi
  line=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran)( |,|$)' "$log" | grep -E '[0-9]+ |no tests' | tail -1)
  [ -n "$line" ] || line=$(grep -v '^\s*$' "$log" | tail -1)
  line=${line//|//}
  line=$(echo "$line" | sed -E 's/^=+ //; s/ =+$//; s/ in [0-9.]+s.*//')
  echo "${line:0:110}"
}

row() { printf '%s|%s|%s|%s\n' "$2" "$3" "$4" "$5" > "$out/rows/$1"; }

run_check() {  # NAME INDEX PHASE_END: run one check under min(its limit, time left in the phase)
  local name=$1 idx=$2 phase_end=$3 log="$out/logs/$1.log" reason lim left start=$SECONDS rc
  reason=$(skip_reason "$name")
  [ "$reason" = "not in --only" ] && return
  if [ -n "$reason" ]; then row "$idx" "$name" SKIP 0 "$reason"; return; fi
  lim=${OVERRIDE[$name]:-${LIMIT[$name]}}
  left=$((phase_end - SECONDS))
  [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -lt 5 ]; then row "$idx" "$name" SKIP 0 "out of time (--budget $budget)"; return; fi
  local cmd=${CMD[$name]}
  echo "\$ $cmd   # limit ${lim}s" > "$log"
  echo "[$((SECONDS - T0))s] $name: started (limit ${lim}s, log $log)"
  GPU_CHECK_TAG="$RUN_TAG.$name" timeout -k 10 -s INT "$lim" bash -c "$cmd" >> "$log" 2>&1
  rc=$?
  local detail leftover secs=$((SECONDS - start))
  detail=$(detail_of "$log" "$name")
  leftover=$(kill_tagged "$RUN_TAG.$name")
  [ -n "$leftover" ] && echo "$leftover" >> "$log" && detail="$detail (${leftover%%:*})"
  if [ "$rc" -eq 0 ]; then
    row "$idx" "$name" pass "$secs" "$detail"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    row "$idx" "$name" FAIL "$secs" "timed out after ${lim}s; ${log#"$out"/}"
  else
    row "$idx" "$name" FAIL "$secs" "rc $rc: $detail; ${log#"$out"/}"
  fi
  echo "[$((SECONDS - T0))s] $name: $(cut -d'|' -f2 "$out/rows/$idx")"
}

if [ "$dry" = 1 ]; then
  echo "gpu_check ($mode, budget ${budget}s): check | lane | limit s | when | command"
  for name in "${NAMES[@]}"; do
    echo "$name | ${LANE[$name]} | ${OVERRIDE[$name]:-${LIMIT[$name]}} | ${WHEN[$name]} | ${CMD[$name]}"
  done
  exit 0
fi

mkdir -p "$out/logs" "$out/rows" "$WORK" || die "cannot create $out or $WORK"
rm -f "$out"/rows/* "$out"/logs/*.log
RUN_TAG="gpu_check.$$"
T0=$SECONDS
trap 'kill_tagged "$RUN_TAG" >/dev/null' EXIT
lane_names() { local n; for n in "${NAMES[@]}"; do [ "${LANE[$n]}" = "$1" ] && echo "$n"; done; }
index_of() { local i; for i in "${!NAMES[@]}"; do [ "${NAMES[$i]}" = "$1" ] && printf '%02d' "$i"; done; }
run_lane() { local n; for n in $(lane_names "$1"); do run_check "$n" "$(index_of "$n")" "$2"; done; }

[ -n "$wheels" ] && export PYTHONPATH="$REPO/src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
run_lane 0 $((T0 + 130))
phase1_end=$((T0 + budget - 165))  # the lanes; then 160 s for the benchmarks
for lane in a b c; do run_lane "$lane" "$phase1_end" & done
wait
run_lane z $((T0 + budget - 5))

# the runs' logs and metrics (small) beside the check logs; the runs' weights stay in WORK
for d in "$WORK"/rl_* "$WORK"/moe_replay "$WORK"/megatron_rl_ckpt; do
  [ -d "$d" ] || continue
  mkdir -p "$out/runs/$(basename "$d")"
  cp -r "$d/logs" "$d/metrics" "$out/runs/$(basename "$d")/" 2>/dev/null
done
{
  echo "GPU check ($mode), $(date -u +%Y-%m-%dT%H:%MZ), checkout $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  grep -m1 '^python ' "$out/logs/versions.log" 2>/dev/null
  echo
  echo "| check | result | seconds | detail |"
  echo "|---|---|---|---|"
  for f in "$out"/rows/*; do IFS='|' read -r n r s d < "$f"; echo "| $n | $r | $s | $d |"; done
  echo
  echo "total $((SECONDS - T0)) s; logs in $out/logs"
} | tee "$out/table.md"
failed=$(cut -d'|' -f2 "$out"/rows/* | grep -c '^FAIL$')
exit "$failed"
