"""Every script of examples/python/ runs as docs/python.md says and prints what the page shows: a refinement that
converges to its truth (a small bank problem: seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "python").glob("*.py"))


def test_there_are_examples():
    assert EXAMPLES, "examples/python/ holds no script"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "status: converged" in done.stdout, done.stdout[-2000:]
    page = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")
    assert f"examples/python/{script.name}" in page, f"docs/python.md does not show {script.name}"
