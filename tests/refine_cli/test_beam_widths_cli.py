"""nbtorch-refine and the beam's widths: bad settings are one line, exit 2, nothing written; a width refines."""

from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import SMALL_MODEL, simulate
from nbtorch.io import write_cbf

SPREAD = SMALL_MODEL + " -dispersion 0.5 -dispsteps 3"
CASES = {
    "refine a width with one wavelength": (["--model", SMALL_MODEL, "--refine", "scale,dispersion"],
                                           "refining dispersion needs -dispersion > 0 and -dispsteps > 1 in the model"),
    "refine a divergence with one direction": (["--model", SPREAD, "--refine", "scale,divergence_v"],
                                               "refining divergence_v needs -vdivrange (or -divergence) > 0"),
    "group beam with one source": (["--model", SMALL_MODEL, "--refine", "scale,beam"],
                                   "beam: the model's beam has one source"),
    "negative start width": (["--model", SPREAD, "--refine", "scale,beam", "--start", "dispersion=-0.1"],
                             "start: dispersion=-0.1 is impossible (a width must be >= 0)"),
    "start width without spread": (["--model", SMALL_MODEL, "--start", "dispersion=0.1"],
                                   "dispersion 0.1: the model has one wavelength"),
    "negative width in the model": (["--model", SMALL_MODEL + " -dispersion -0.2"], "-dispersion"),
}


@pytest.fixture
def image(tmp_path):
    rng = np.random.default_rng(0)
    write_cbf(tmp_path / "ok.cbf", rng.integers(0, 10, (32, 32)).astype(np.int32), {"pixel_size_mm": 0.1})
    return tmp_path


@pytest.mark.parametrize("case", list(CASES))
def test_bad_width_is_one_line_exit_2(refine_cli, image, case):
    argv, expected = CASES[case]
    r = refine_cli("--image", "ok.cbf", *argv)
    assert r.code == 2, (r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbtorch-refine: error: "), r.err
    assert expected in lines[0], lines[0]
    assert not any(p.name.startswith("result") for p in r.tmp.iterdir()), sorted(p.name for p in r.tmp.iterdir())


def test_width_refines_and_is_reported(refine_cli, tmp_path):
    """An image made with a 1 % bandwidth, fitted from 0.5 %: the width is free, reported in % and moves."""
    write_cbf(tmp_path / "spots.cbf", simulate(SMALL_MODEL + " -dispersion 1 -dispsteps 3", scale=50.0),
              {"pixel_size_mm": 0.1})
    r = refine_cli("--image", "spots.cbf", "--model", SPREAD, "--refine", "scale,background,beam", "--max-steps", "3",
                   "--out", "res.h5", "--no-esds")
    assert r.code == 0, r.err
    doc = r.json("res.json")
    assert doc["units"]["dispersion"] == "%" and doc["initial_params"]["dispersion"] == pytest.approx(0.5)
    assert "dispersion" in doc["free"] and doc["params"]["dispersion"] > 0.5
    assert doc["params"]["divergence_h"] == 0.0 and "divergence_h" not in doc["free"]
