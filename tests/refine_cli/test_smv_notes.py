"""SMV headers (issue #18): every key is used or said not to be used, one line per reason, for the files the
``nbtorch`` command writes and for hand-made ADSC-style headers with more keys."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nbtorch.cli.main import main
from nbtorch.io import write_smv
from refine.inputs.images import load_image
from refine.inputs.start_model import model_config

from cli_helpers import CRYSTAL


def _note(notes, start):
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


def _said(notes, key):
    """The notes that name header key ``key`` as a word (``PHI`` is not ``PHI_START``)."""
    return [n for n in notes if re.search(rf"(?<![A-Z_]){re.escape(key)}(?![A-Z_])", n)]


@pytest.mark.parametrize("model", ["-mosflm", "-xds", "-xds -twotheta 0"])
def test_every_key_of_an_nbtorch_intfile_is_used_or_said(tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    argv = (f"{CRYSTAL} -lambda 1 -distance 40 -pixel 0.1 -detpixels 24 -phi 5 -osc 0.1 -nonoise -nopgm "
            "-noprogress -intfile x.img").split()
    assert main(argv) == 0
    obs = load_image("x.img")
    keys = obs.header["fields"]
    assert {"HEADER_BYTES", "DIALS_ORIGIN", "XDS_ORGX", "CLOSE_DISTANCE", "DETECTOR_SN", "BEAMLINE"} <= set(keys)
    _, _, notes = model_config(f"{model} {CRYSTAL}", obs)
    for key in keys:
        assert _said(notes, key), (key, notes)
    assert _note(notes, "HEADER_BYTES 512; DIM 2; BYTE_ORDER little_endian; TYPE unsigned_short; SIZE1 24; SIZE2 24") \
        .endswith("from the header: file layout: read, not model values")
    beam = _note(notes, "BEAM_CENTER_X ")
    assert beam.endswith("not used (the same beam centre in other programs' terms; the model's is DENZO_Y_BEAM, "
                         "DENZO_X_BEAM)")
    for key in ("BEAM_CENTER_Y", "ADXV_CENTER_X", "MOSFLM_CENTER_Y", "DIALS_ORIGIN", "XDS_ORGX", "XDS_ORGY"):
        assert f"; {key} " in beam
    assert "(DENZO_Y_BEAM, DENZO_X_BEAM) as " in _note(notes, "beam centre (")
    _note(notes, "pixel 0.1 mm from the header (PIXEL_SIZE)")
    _note(notes, "rotation OSC_START 5 deg, OSC_RANGE 0.1 deg from the header as -phi 5 -osc 0.1")
    assert _note(notes, "PHI 5 from the header") == "PHI 5 from the header: not used (OSC_START is taken)"
    assert "not used (the model's distance is DISTANCE" in _note(notes, "CLOSE_DISTANCE 40 from the header")
    assert "not used (exposure, counting, provenance" in _note(notes, "DETECTOR_SN 000; BEAMLINE fake from the header")
    if "-twotheta" in model:
        assert "not used (--model gives the detector's orientation: -twotheta)" in _note(notes, "TWOTHETA 0 deg")
    else:
        _note(notes, "TWOTHETA 0 deg from the header: the detector is normal to the beam")


def test_a_hand_made_adsc_header(tmp_path):
    header = {"DIM": 2, "PIXEL_SIZE": 0.2, "DISTANCE": 80, "WAVELENGTH": 1.3, "MOSFLM_CENTER_X": 3.3,
              "MOSFLM_CENTER_Y": 4.2, "BEAM_CENTER_X": 3.4, "BEAM_CENTER_Y": 4.3, "PHI": 10, "OSC_WIDTH": 0.1,
              "OMEGA": 3, "AXIS": "phi", "BIN": "2x2", "DATE": "Tue Nov 3 10:00:00 2026", "TIME": 1.5,
              "DETECTOR_SN": 915, "ADC": "slow", "UNIF_PED": 1500, "OVERLOAD": 0, "CCD_IMAGE_SATURATION": 65000}
    write_smv(tmp_path / "x.img", np.zeros((36, 40), dtype=np.uint16), header)
    obs = load_image(tmp_path / "x.img")
    # MOSFLM's centre (from the first pixel's centre) is taken before ADSC's, plus half a pixel
    assert obs.geometry["beam_x_px"] == pytest.approx(21.5) and obs.geometry["beam_y_px"] == pytest.approx(17.0)
    assert (obs.geometry["phi_deg"], obs.geometry["osc_deg"], obs.geometry["saturation"]) == (10.0, 0.1, 65000.0)
    cfg, _, notes = model_config(f"-xds {CRYSTAL}", obs)
    assert (cfg.phi_deg, cfg.osc_deg) == (10.0, pytest.approx(0.1))
    for key in obs.header["fields"]:
        assert _said(notes, key), (key, notes)
    _note(notes, "rotation PHI 10 deg, OSC_WIDTH 0.1 deg from the header as -phi 10 -osc 0.1")
    assert "(MOSFLM_CENTER_Y, MOSFLM_CENTER_X)" in _note(notes, "beam centre (21.5, 17) px")
    assert "the model's is MOSFLM_CENTER_Y, MOSFLM_CENTER_X" in _note(notes, "BEAM_CENTER_X 3.4; BEAM_CENTER_Y 4.3")
    _note(notes, "CCD_IMAGE_SATURATION 65000 counts from the header: pixels at or above it are masked")
    assert _note(notes, "OVERLOAD 0") == "OVERLOAD 0 from the header: not used (not a positive count)"
    assert "not used (goniometer setting" in _note(notes, "OMEGA 3 from the header")
    assert "not used (the model rotates about its spindle axis" in _note(notes, "AXIS phi from the header")
    assert "not used (PIXEL_SIZE is the size of the pixels as stored)" in _note(notes, "BIN 2x2")
    rest = _note(notes, "DATE Tue Nov 3 10:00:00 2026; TIME 1.5; DETECTOR_SN 915; ADC slow; UNIF_PED 1500 from")
    assert rest.endswith("their effect on counts)")
    _note(notes, "HEADER_BYTES 512; DIM 2; BYTE_ORDER little_endian; TYPE unsigned_short; SIZE1 40; SIZE2 36 from")


def test_smv_values_that_cannot_be_used(tmp_path):
    write_smv(tmp_path / "x.img", np.zeros((36, 40), dtype=np.uint16),
              {"DISTANCE": 0, "WAVELENGTH": 1.3, "DENZO_X_BEAM": 3.4, "DENZO_Y_BEAM": 4.3, "CLOSE_DISTANCE": 80})
    obs = load_image(tmp_path / "x.img")
    assert obs.geometry == {"wavelength_A": 1.3, "saturation": 65535.0}  # no pixel size: no beam centre
    _, _, notes = model_config(f"-xds {CRYSTAL} -pixel 0.2 -distance 80", obs)
    assert _note(notes, "DISTANCE 0") == "DISTANCE 0 from the header: not used (not a positive number)"
    assert _note(notes, "DENZO_X_BEAM 3.4; DENZO_Y_BEAM 4.3").endswith(
        "not used (no PIXEL_SIZE to turn a beam centre into pixels)")
    assert "a close distance belongs in --model" in _note(notes, "CLOSE_DISTANCE 80")


def test_a_second_saturation_key_is_said(tmp_path):
    write_smv(tmp_path / "x.img", np.zeros((36, 40), dtype=np.uint16),
              {"PIXEL_SIZE": 0.2, "SATURATED_VALUE": 60000, "CCD_IMAGE_SATURATION": 65000})
    obs = load_image(tmp_path / "x.img")
    assert obs.geometry["saturation"] == 60000
    _, _, notes = model_config(f"-xds {CRYSTAL} -lambda 1 -distance 80", obs)
    _note(notes, "SATURATED_VALUE 60000 counts from the header: pixels at or above it are masked")
    assert _note(notes, "CCD_IMAGE_SATURATION 65000") == \
        "CCD_IMAGE_SATURATION 65000 from the header: not used (the saturation is SATURATED_VALUE)"
