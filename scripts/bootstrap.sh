#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
# Installs the CPU torch wheel first (torch==2.13.0 is on local disk on our machines;
# elsewhere any torch 2.x works), then nbtorch in editable mode with its test and optional extras.
# With --browser (scripts/test.sh) it also installs Debian's chromium where it is missing and apt-get can run
# (root): the HTML report's test opens the page in a real headless browser.
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
    .venv/bin/python -m pip install -q -e ".[test,report,formats]"
    echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--browser" ] && ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "bootstrap: installing chromium (Debian) for the report's browser test" >&2
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >/dev/null 2>&1 \
            || echo "bootstrap: chromium could not be installed; the browser test will say so" >&2
    else
        echo "bootstrap: no chromium and no root apt-get; the report's browser test will be skipped" >&2
    fi
fi
