"""Shared test fixtures: where the golden C images live, and small helpers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("NBTORCH_GOLDEN", ROOT.parent / "shared" / "golden"))

# gradient tests and gradcheck must never meet a compiled graph
os.environ.setdefault("NANOBRAGG_DISABLE_COMPILE", "1")


def golden_cases() -> list[str]:
    """Every case folder under shared/golden that has args.txt and float.bin."""
    if not GOLDEN.is_dir():
        return []
    return sorted(p.name for p in GOLDEN.iterdir() if (p / "args.txt").is_file() and (p / "float.bin").is_file())


def golden_args(case: str) -> list[str]:
    return (GOLDEN / case / "args.txt").read_text().split()


def golden_image(case: str, shape) -> np.ndarray:
    return np.fromfile(GOLDEN / case / "float.bin", "<f4").reshape(shape)


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
