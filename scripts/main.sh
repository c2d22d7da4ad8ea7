#!/usr/bin/env bash
# The main job (README): bootstrap .venv, then refine a synthetic still with known truth.
# nbtorch-refine simulates the bank problem "tetragonal_mosflm" (a 46 x 46 x 56 A tetragonal crystal on a
# 64 x 64-pixel detector, Poisson noise, a 40-count pedestal), starts from a model that is wrong the way
# an indexing solution is (cell +1 %, orientation 0.3 deg, beam centre 2 pixels, mosaic x2, N -25 %,
# scale x3), refines it, and prints truth, start and refined values with esds side by side, and where
# the TensorBoard logs are.  Outputs: out/main/result.h5, out/main/result.json, out/main/runs/.
# A few seconds on 2 idle CPU cores once set up (the first bootstrap installs the packages).  Extra arguments
# pass through to nbtorch-refine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export NBTORCH_CACHE_DIR=${NBTORCH_CACHE_DIR:-$PWD/.nbtorch_cache}
mkdir -p out/main
rm -rf out/main/runs  # one run per log directory, so TensorBoard's curves are this run's
exec .venv/bin/nbtorch-refine --problem tetragonal_mosflm --size 64 \
    --refine scale,background,orientation,beam_centre,cell,mosaic --coarse --max-steps 100 \
    --out out/main/result.h5 --json out/main/result.json --logdir out/main/runs "$@"
