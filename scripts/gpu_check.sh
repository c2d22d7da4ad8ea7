#!/usr/bin/env bash
# The GPU checks (issue #21's "on a GPU: the same table, and the CUDA path passes the parity cases"), in one
# go, on a machine with CUDA and the project's packages, run from the checkout:
#   1. tests/test_cuda.py (-m gpu): C parity of every golden case on the GPU (float64 eager, float32
#      correlation, a few compiled with Triton), the command with -device cuda, gradients equal to the CPU's,
#      a refinement and joint refinements (with shared structure factors: needs gemmi) reaching the CPU's values;
#   2. the forward harness (python -m nbtorch.tools.bench) on cuda: heavy and cubic, 1024^2 and 2048^2, with
#      gradients, beside a C nanoBragg build if C_BIN names one (timed on the machine's cores);
#   3. the refinement harness (python -m refine.tools.bench) on the thaumatin tutorial with --device cuda, and the
#      README's main job on the GPU.
# Environment: OUT (logs and JSON, at most 7 files; default out/gpu), DEVICE (default cuda), PYTHON (default
# python3), C_BIN (optional), SHARED (the folder holding golden/ and real/; default ../shared),
# STEP_TIMEOUT_SCALE (multiplies each step's time limit).
# Each step has a time limit, so one slow step does not hide the others' results; the exit status is the
# number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
PY=${PYTHON:-python3}
SHARED=$(cd "${SHARED:-../shared}" && pwd) || exit 1  # absolute: the parity tests chdir into each case
SCALE=${STEP_TIMEOUT_SCALE:-1}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu tries the script itself where no GPU is lent
export NBTORCH_TEST_DEVICE=$DEVICE
mkdir -p "$OUT"
export NBTORCH_GOLDEN=${NBTORCH_GOLDEN:-$SHARED/golden}
export NBTORCH_CACHE_DIR=${NBTORCH_CACHE_DIR:-$PWD/.nbtorch_cache_gpu}
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, its output into $OUT/NAME.txt and the log
    local name=$1 limit=$(( $2 * SCALE )); shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.txt"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
import nbtorch, refine, losses  # noqa: F401  the packages import here
EOF

timeout_opt=()
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout 90)
step pytest 150 "$PY" -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider "${timeout_opt[@]}" --tb=short

c_opt=()
[ -n "${C_BIN:-}" ] && c_opt=(--c-bin "$C_BIN" --c-parity --threads "$(nproc)")
step bench_heavy 90 "$PY" -m nbtorch.tools.bench --device "$DEVICE" --case heavy --sizes 1024,2048 --dtype float32 \
    --iterations 7 --grad "${c_opt[@]}" --json "$OUT/bench_heavy.json"
step bench_cubic 60 "$PY" -m nbtorch.tools.bench --device "$DEVICE" --case cubic --sizes 1024,2048 --dtype float32 \
    --iterations 21 --grad "${c_opt[@]}" --json "$OUT/bench_cubic.json"

# the tutorial's configuration with its ../shared paths pointed at $SHARED
toml=${TMPDIR:-/tmp}/nbtorch_gpu_thaumatin.toml
sed "s#\.\./shared/#$SHARED/#g; s#out/thaumatin/#${TMPDIR:-/tmp}/nbtorch_gpu_thaumatin/#g" examples/thaumatin_still.toml >"$toml"
step refine_bench 150 "$PY" -m refine.tools.bench --repeats 10 --esd-repeats 3 --main-job --json "$OUT/refine_bench.json" \
    -- --config "$toml" --device "$DEVICE"
echo "failed steps: $failed"
exit "$failed"
