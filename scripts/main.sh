#!/usr/bin/env bash
# The main job (README): bootstrap .venv, then simulate the bundled example
# (a triclinic crystal, 256x256 detector) with the nbtorch command, writing
# the images to out/main/ and printing their statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
mkdir -p out/main
args=$(cat examples/triclinic.args)
cd out/main
# shellcheck disable=SC2086
exec ../../.venv/bin/python -m nbtorch $args "$@"
