#!/usr/bin/env bash
# The GPU checks and figures (docs/performance.md "On a GPU"), in one go, on a machine with CUDA and the
# project's packages, run from the checkout:
#   pytest        tests/test_cuda.py (-m gpu): C parity of every golden case on the GPU (float64 eager, float32
#                 correlation, a few compiled with Triton), the command with -device cuda, gradients equal to the
#                 CPU's, refinements and joint refinements reaching the CPU's values, the CUDA graph of a stage's
#                 loss and gradient equal to the plain evaluation;
#   bench_heavy   the forward harness (python -m nbtorch.tools.bench): heavy 512^2-2048^2 with gradients and the
#   bench_cubic   forward replayed from a CUDA graph, cubic likewise without gradients; the fixed cost per call and
#                 the cost per evaluation fitted over the sizes; beside a C nanoBragg build if C_BIN names one;
#   refine_bench  the refinement harness (python -m refine.tools.bench) on the thaumatin tutorial: loss and gradient
#                 (CUDA graph and plain), the fixed cost over two sizes, the esds, the README's main job on the GPU;
#   tutorial      the tutorial refined on the GPU (nbtorch-refine --config ... --device cuda), its kernels compiled
#                 by refine_bench: the loop's time, and per step in tutorial.h5's history/elapsed_s;
#   main_cpu      the README's main job on 2 of the machine's CPU cores, beside refine_bench's GPU run;
#   serial_bench  the refinement harness on one still of the serial sets (experiments.serial_data: cubic_mosflm,
#                 64 x 64, compiled): a small still's loss and gradient, CUDA graph and plain, fixed cost.
# Environment: OUT (default out/gpu; what comes back: steps.log, the harnesses' JSON, tutorial.json and .h5,
# and with CACHE_OUT=1 cache.tgz, the nbtorch cache folder: the compiled kernels unless Inductor's cache is
# elsewhere), DEVICE (default cuda), PYTHON (default python3), C_BIN
# (optional), SHARED (the folder holding golden/ and real/; default ../shared), STEP_TIMEOUT_SCALE (multiplies
# each step's time limit), STEPS (the steps to run and their order, default all in the order above).  Each
# step has a time limit, so one slow step does not hide the others' results; the exit status is the number of
# steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
PY=${PYTHON:-python3}
SHARED=$(cd "${SHARED:-../shared}" && pwd) || exit 1  # absolute: the parity tests chdir into each case
SCALE=${STEP_TIMEOUT_SCALE:-1}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu tries the script itself where no GPU is lent
STEPS=${STEPS:-pytest bench_heavy bench_cubic refine_bench tutorial main_cpu serial_bench}
export NBTORCH_TEST_DEVICE=$DEVICE
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/steps.log
export NBTORCH_GOLDEN=${NBTORCH_GOLDEN:-$SHARED/golden}
export NBTORCH_CACHE_DIR=${NBTORCH_CACHE_DIR:-$PWD/.nbtorch_cache_gpu}
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nbtorch_gpu.XXXXXX")
failed=0

step() {  # step NAME SECONDS COMMAND...: with a time limit, its output appended to steps.log, its tail shown
    local name=$1 limit=$(( $2 * SCALE )); shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$WORK/$name.txt" 2>&1
    local rc=$?
    cat "$WORK/$name.txt" >>"$LOG"
    grep -v '^USDT:' "$WORK/$name.txt" | tail -n 30
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
import nbtorch, refine, losses  # noqa: F401  the packages import here
EOF

timeout_opt=()
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout 120)
c_opt=()
[ -n "${C_BIN:-}" ] && c_opt=(--c-bin "$C_BIN" --c-parity --threads "$(nproc)")
graph_opt=()
[[ $DEVICE == cuda* ]] && graph_opt=(--cuda-graph)
# the tutorial's configuration with its ../shared paths pointed at $SHARED
toml=$WORK/thaumatin.toml
sed "s#\.\./shared/#$SHARED/#g; s#out/thaumatin/#$WORK/thaumatin/#g" examples/thaumatin_still.toml >"$toml"

for name in $STEPS; do  # in the order asked for
    case $name in
    pytest) step pytest 300 "$PY" -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider "${timeout_opt[@]}" \
        --tb=short ;;
    bench_heavy) step bench_heavy 150 "$PY" -m nbtorch.tools.bench --device "$DEVICE" --case heavy \
        --sizes 512,1024,2048 --dtype float32 --iterations 7 --grad "${graph_opt[@]}" "${c_opt[@]}" \
        --json "$OUT/bench_heavy.json" ;;
    bench_cubic) step bench_cubic 90 "$PY" -m nbtorch.tools.bench --device "$DEVICE" --case cubic \
        --sizes 512,1024,2048 --dtype float32 --iterations 21 "${graph_opt[@]}" "${c_opt[@]}" \
        --json "$OUT/bench_cubic.json" ;;
    refine_bench) step refine_bench 300 "$PY" -m refine.tools.bench --repeats 10 --esd-repeats 3 --fractions 1/4,1 \
        --main-job --json "$OUT/refine_bench.json" -- --config "$toml" --device "$DEVICE" ;;
    tutorial) step tutorial 240 "$PY" -m refine.cli --config "$toml" --device "$DEVICE" --json "$OUT/tutorial.json" \
        --out "$OUT/tutorial.h5" --checkpoint "$WORK/tutorial.ckpt.h5" ;;
    main_cpu) step main_cpu 120 "$PY" -c "import json; from refine.tools.bench import main_job_seconds; \
print(json.dumps(main_job_seconds(('--device', 'cpu'), threads=2)))" ;;
    serial_bench) step serial_bench 150 "$PY" -m refine.tools.bench --repeats 20 --esd-repeats 0 --fractions 1/4,1 \
        --json "$OUT/serial_bench.json" -- --problem cubic_mosflm --size 64 --compile \
        --refine scale,background,orientation --device "$DEVICE" ;;
    *) echo "unknown step $name (known: pytest bench_heavy bench_cubic refine_bench tutorial main_cpu serial_bench)" \
           | tee -a "$LOG"
       failed=$((failed + 1)) ;;
    esac
done
if [ "${CACHE_OUT:-0}" = 1 ] && [ -d "$NBTORCH_CACHE_DIR" ]; then  # the compiled kernels, for a later machine
    tar czf "$OUT/cache.tgz" -C "$NBTORCH_CACHE_DIR" . && ls -l "$OUT/cache.tgz"
fi
echo "work files (the tutorial's outputs, each step's output): $WORK"
echo "failed steps: $failed" | tee -a "$LOG"
exit "$failed"
