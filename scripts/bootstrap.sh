#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
# Installs the CPU torch wheel first (torch==2.13.0 is on local disk on our machines;
# elsewhere any torch 2.x works), then nbtorch in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.nbtorch-stamp
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
        .venv/bin/python -m pip install -q torch==2.13.0 || .venv/bin/python -m pip install -q "torch>=2.3,<3"
    fi
    .venv/bin/python -m pip install -q -e ".[test]"
    echo "$want" > "$stamp"
fi
