"""Where the golden C images live, and helpers to read them (imported by the tests).

A plain module, not ``conftest.py``: other test folders have conftests of their
own, and ``from conftest import ...`` would pick whichever was imported first.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("NBTORCH_GOLDEN", ROOT.parent / "shared" / "golden"))
#: the reason every golden-based test gives when the folder is missing (shown by pytest -ra)
MISSING = (f"golden reference images not found at {GOLDEN} (shared/golden beside the checkout, or set "
           "NBTORCH_GOLDEN): the C-parity tests did not run")
#: skip mark of the tests that read the golden folder
needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=MISSING)


def require_golden() -> None:
    """Skip (with :data:`MISSING`) when the golden folder is missing; under ``CI=true`` fail instead, so a CI run
    without the reference images cannot pass silently."""
    if GOLDEN.is_dir():
        return
    if os.environ.get("CI") == "true":
        pytest.fail(MISSING)
    pytest.skip(MISSING)


def golden_cases() -> list[str]:
    """Every case folder under shared/golden that has args.txt and float.bin."""
    if not GOLDEN.is_dir():
        return []
    return sorted(p.name for p in GOLDEN.iterdir() if (p / "args.txt").is_file() and (p / "float.bin").is_file())


def golden_args(case: str) -> list[str]:
    return (GOLDEN / case / "args.txt").read_text().split()


def golden_image(case: str, shape) -> np.ndarray:
    return np.fromfile(GOLDEN / case / "float.bin", "<f4").reshape(shape)


def assert_parity(img: np.ndarray, ref: np.ndarray, case: str) -> None:
    """The C-parity acceptance (float64): max|diff| <= 1e-5 max(C) and |sum diff| / sum C <= 1e-6."""
    assert ref.max() > 0, f"{case}: golden image is empty"
    dmax = np.abs(img - ref).max() / ref.max()
    dsum = abs(img.sum() - ref.sum()) / ref.sum()
    assert dmax <= 1e-5, f"{case}: max|diff|/max = {dmax:.3g}"
    assert dsum <= 1e-6, f"{case}: |sum diff|/sum = {dsum:.3g}"


def simulate_case(case: str, dtype, **simulator_options):
    """``(image as float64 numpy, simulator)`` of a golden case's arguments with ``-c_parity``, built in the case
    folder (its args name input files relative to it; nothing is written); ``simulator_options`` go to
    :class:`nbtorch.Simulator` (``device``, ``compile``)."""
    import torch

    from nbtorch import Simulator, config_from_args

    old = os.getcwd()
    os.chdir(GOLDEN / case)
    try:
        sim = Simulator(config_from_args(golden_args(case) + ["-c_parity"]), dtype=dtype, **simulator_options)
        with torch.no_grad():
            img = sim()
        return img.double().cpu().numpy(), sim
    finally:
        os.chdir(old)
