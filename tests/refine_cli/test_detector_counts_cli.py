"""nbtorch-refine turns counts into photons (--gain, --adc-offset, the header's constants) and records them."""

from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import SMALL_MODEL, simulate
from nbtorch.io.smv import write_smv

QUICK = ("--refine", "scale,background", "--max-steps", "20")


def test_smv_gain_and_offset_from_the_header(refine_cli, tmp_path):
    """An image recorded with 2 counts per photon and a 40-count offset: the header's GAIN and ADC_OFFSET turn it
    into photons (the fit is at the noise level, the background is the simulated 5 photons); --gain overrides."""
    photons = simulate(SMALL_MODEL, background=5.0, seed=3)
    write_smv(tmp_path / "g2.img", (2 * photons + 40).astype(np.uint16), {"GAIN": "2", "ADC_OFFSET": "40"})
    r = refine_cli("--image", "g2.img", "--model", SMALL_MODEL, *QUICK)
    assert r.code == 0, r.err
    assert "detector counts: gain 2 counts/photon, ADC offset 40 counts (SMV header GAIN=2, ADC_OFFSET=40)" in r.out
    doc = r.json()
    assert doc["detector_counts"]["gain"] == 2.0 and doc["detector_counts"]["adc_offset"] == 40.0
    assert 0.7 < doc["fit"]["excess"] < 1.4, doc["fit"]
    assert doc["params"]["background"] == pytest.approx(5.0, abs=0.5)
    r = refine_cli("--image", "g2.img", "--model", SMALL_MODEL, "--gain", "1", *QUICK)
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["detector_counts"]["gain"] == 1.0 and doc["detector_counts"]["source"].startswith("--gain 1; otherwise")
    assert doc["params"]["background"] == pytest.approx(10.0, abs=1.0)  # twice the photons


def test_problem_pedestal_is_the_adc_offset(refine_cli):
    r = refine_cli("--problem", "tetragonal_mosflm", "--size", "32", *QUICK)
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["detector_counts"] == {"gain": 1.0, "adc_offset": 40.0, "source": doc["detector_counts"]["source"]}
    assert doc["truth"]["background"] == 5.0
    r = refine_cli("--problem", "tetragonal_mosflm", "--size", "32", "--adc-offset", "0", *QUICK)
    assert r.code == 0, r.err
    before = r.json()
    assert before["truth"]["background"] == 45.0  # the pedestal taken for photons, as before
    assert before["initial_params"]["background"] - doc["initial_params"]["background"] == pytest.approx(40.0)


@pytest.mark.parametrize("argv, message", [
    (("--gain", "0"), "--gain: counts per photon must be a finite number > 0, got 0.0"),
    (("--gain", "-2"), "--gain: counts per photon must be a finite number > 0"),
    (("--gain", "nan"), "--gain: counts per photon must be a finite number > 0, got nan"),
    (("--adc-offset", "inf"), "--adc-offset: counts must be a finite number, got inf"),
], ids=["gain zero", "gain negative", "gain nan", "offset inf"])
def test_bad_gain_or_offset_is_one_line_exit_2_nothing_written(refine_cli, tmp_path, argv, message):
    r = refine_cli("--problem", "tetragonal_mosflm", "--size", "16", *argv)
    assert r.code == 2, (r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbtorch-refine: error: ") and message in lines[0], r.err
    assert not any(tmp_path.iterdir())


def test_bad_header_gain_is_one_line_exit_2(refine_cli, tmp_path):
    write_smv(tmp_path / "bad.img", np.full((32, 32), 45, dtype=np.uint16), {"GAIN": "none"})
    r = refine_cli("--image", "bad.img", "--model", SMALL_MODEL)
    assert r.code == 2, (r.out, r.err)
    assert r.err.strip().splitlines() == [
        "nbtorch-refine: error: bad.img: SMV header GAIN='none' is not a usable gain (> 0); give --gain/--adc-offset"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.img"]
