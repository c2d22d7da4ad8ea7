"""-img and -mask: SMV header ingestion with the C's keys and precedence; masked pixels skipped."""

from __future__ import annotations

import os

import numpy as np
import pytest

from golden import GOLDEN, golden_cases
from nbtorch import Simulator, config_from_args
from nbtorch.cli.main import main
from nbtorch.io import read_raw_float, read_smv, write_smv

HEADER = {"PIXEL_SIZE": "0.2", "DISTANCE": "150", "CLOSE_DISTANCE": "149", "WAVELENGTH": "1.5",
          "BEAM_CENTER_X": "3.1", "BEAM_CENTER_Y": "2.9", "XDS_ORGX": "16.5", "XDS_ORGY": "12.5",
          "PHI": "5", "OSC_RANGE": "0.5", "TWOTHETA": "2"}
CRYSTAL = "-cell 100 100 100 90 90 90 -default_F 100 -N 3".split()



def _smv(path, shape=(24, 32), header=HEADER, zero=None):
    img = np.ones(shape, dtype=np.uint16)
    if zero is not None:
        img[zero] = 0
    write_smv(path, img, header)
    return img


def test_img_header_seeds_the_detector(workdir):
    _smv("h.img")
    cfg = config_from_args(CRYSTAL + ["-img", "h.img"])
    assert (cfg.fpixels, cfg.spixels) == (32, 24)
    assert cfg.pixel_mm == 0.2 and cfg.distance_mm == 150 and cfg.close_distance_mm == 149
    assert cfg.wavelength_A == 1.5 and cfg.Xbeam_mm == 3.1 and cfg.Ybeam_mm == 2.9  # -img: no flip
    assert cfg.ORGX == 16.5 and cfg.ORGY == 12.5  # found as XDS_ORGX/XDS_ORGY, like the C's substring search
    assert cfg.phi_deg == 5 and cfg.osc_deg == 0.5 and cfg.twotheta_deg == 2
    assert cfg.pivot is None and cfg.img_file == "h.img"


def test_flags_override_the_header_wherever_they_are(workdir):
    _smv("h.img")
    for argv in (["-lambda", "2", "-detpixels", "40", "-Xbeam", "4", "-img", "h.img"],
                 ["-img", "h.img", "-lambda", "2", "-detpixels", "40", "-Xbeam", "4"]):
        cfg = config_from_args(CRYSTAL + argv)
        assert cfg.wavelength_A == 2 and cfg.fpixels == cfg.spixels == 40 and cfg.Xbeam_mm == 4
        assert cfg.Ybeam_mm == 2.9 and cfg.pixel_mm == 0.2
    cfg = config_from_args(CRYSTAL + ["-img", "h.img", "-distance", "90"])
    assert cfg.distance_mm == 90 and cfg.close_distance_mm is None  # -distance beats CLOSE_DISTANCE
    cfg = config_from_args(CRYSTAL + ["-img", "h.img", "-distance", "90", "-c_parity"])
    assert cfg.close_distance_mm == 149  # the C keeps the header's close distance


def test_mask_header_flips_beam_y_and_img_wins(workdir):
    _smv("m.img")
    cfg = config_from_args(CRYSTAL + ["-mask", "m.img"])
    assert cfg.Ybeam_mm == pytest.approx(24 * 0.2 - 2.9)  # the C's Ybeam = detsize_s - BEAM_CENTER_Y
    assert cfg.Xbeam_mm == 3.1 and cfg.mask_file == "m.img"
    _smv("h.img", header={**HEADER, "BEAM_CENTER_Y": "1.0", "WAVELENGTH": "1.7"})
    cfg = config_from_args(CRYSTAL + ["-img", "h.img", "-mask", "m.img"])  # the C reads -img after -mask
    assert cfg.Ybeam_mm == 1.0 and cfg.wavelength_A == 1.7


def test_mask_skips_zero_pixels(workdir, capsys):
    zero = (slice(5, 9), slice(10, 20))
    _smv("m.img", zero=zero)
    base = CRYSTAL + "-nonoise -nopgm -noprogress -adc 40 -scale 10".split()
    assert main(base + ["-mask", "m.img", "-floatfile", "a.bin", "-intfile", "a.img"]) == 0
    assert "skipping zero-flagged pixels in m.img" in capsys.readouterr().out
    cfg = config_from_args(base + ["-mask", "m.img"])
    mask = Simulator(cfg).setup.pixel_mask
    assert mask.shape == (24, 32) and mask.dtype == bool and not mask[zero].any() and mask.sum() == 24 * 32 - 40
    masked = read_raw_float("a.bin", (24, 32))
    full = Simulator(cfg.replace(mask_file=None))().double().numpy().astype(np.float32)  # same header geometry
    assert full[zero].max() > 0
    assert np.all(masked[zero] == 0)
    np.testing.assert_array_equal(masked[mask], full[mask])
    intimg, _ = read_smv("a.img")
    assert np.all(intimg[zero] == 40)  # as the C: a skipped pixel in the ROI is 0 photons + adc


@pytest.mark.skipif("simple_cubic" not in golden_cases(), reason="no simple_cubic golden case")
def test_img_of_a_golden_case_reproduces_it(workdir):
    """simple_cubic's own int.img header carries its detector: the image and int.img come back."""
    ref = GOLDEN / "simple_cubic"
    argv = ("-cell 100 100 100 90 90 90 -default_F 100 -N 5 -nonoise -nopgm -noprogress -c_parity "
            f"-img {ref / 'int.img'} -floatfile f.bin -intfile i.img").split()
    assert main(argv) == 0
    img = read_raw_float("f.bin", (256, 256)).astype(np.float64)
    gold = np.fromfile(ref / "float.bin", "<f4").reshape(256, 256).astype(np.float64)
    assert np.abs(img - gold).max() <= 1e-5 * gold.max()
    assert (workdir / "i.img").read_bytes() == (ref / "int.img").read_bytes()
