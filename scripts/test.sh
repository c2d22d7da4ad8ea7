#!/usr/bin/env bash
# The test command (README): bootstrap .venv, then run the default suite.
# Long tests are marked `slow` and GPU tests `gpu`; run them with: scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --browser
export NBTORCH_CACHE_DIR=${NBTORCH_CACHE_DIR:-$PWD/.nbtorch_cache}
if [ "$#" -eq 0 ]; then
    set -- -m "not slow and not gpu"
fi
exec .venv/bin/python -m pytest -q "$@"
