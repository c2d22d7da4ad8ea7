"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from golden import GOLDEN

# gradient tests and gradcheck must never meet a compiled graph; tests that want
# torch.compile ask for it explicitly (Simulator(compile=True))
os.environ.setdefault("NANOBRAGG_DISABLE_COMPILE", "1")
# the suite runs on an empty compile cache (CI): precompile's save costs ~30 % more per first compile
# (a stage-A test: 177 s against 138 s) and saves nothing there; tests/test_precompile.py turns it on
os.environ.setdefault("NBTORCH_PRECOMPILE", "0")


@pytest.fixture
def case_copy(tmp_path):
    """Copy a golden case folder to a writable temporary directory and chdir there."""

    def make(case: str) -> Path:
        dst = tmp_path / case
        shutil.copytree(GOLDEN / case, dst)
        for p in dst.iterdir():
            p.chmod(0o644)
        os.chdir(dst)
        return dst

    old = os.getcwd()
    yield make
    os.chdir(old)


@pytest.fixture
def workdir(tmp_path):
    """chdir into a fresh temporary directory for the test."""
    old = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(old)
