"""nbtorch.geometry.beam_centre: the beam-centre rules of the six conventions, both ways, and their users."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.geometry.beam_centre import (
    CONVENTIONS, beam_centre_flags, beam_centre_from_offsets_m, close_from_org_m, close_point_m,
    default_beam_centre_m, detector_offsets_m, header_beam_offsets, org_from_close_px,
)
from nbtorch.cli.main import header_values

CRYSTAL = "-cell 50 60 70 90 90 90 -N 3 -lambda 1.0 -default_F 10 -distance 80 -pixel 0.2 -detpixels_f 40 -detpixels_s 30"
#: flags selecting each convention (CUSTOM: MOSFLM's vectors given explicitly)
SELECT = {"mosflm": "-mosflm", "denzo": "-denzo", "adxv": "-adxv", "xds": "-xds", "dials": "-dials",
          "custom": "-fdet_vector 0 0 1 -sdet_vector 0 -1 0 -odet_vector 1 0 0 -beam_vector 1 0 0 -polar_vector 0 0 1"}
P_M, DETSIZE_S_M = 0.2e-3, 30 * 0.2e-3


def test_six_conventions():
    assert set(CONVENTIONS) == set(SELECT) == {"mosflm", "xds", "dials", "adxv", "denzo", "custom"}
    for conv, flags in SELECT.items():
        assert config_from_args(flags.split()).convention == conv


@pytest.mark.parametrize("conv", CONVENTIONS)
def test_round_trip(conv):
    """canonical -> offsets -> canonical and offsets -> canonical -> offsets, floats and tensors."""
    rng = np.random.default_rng(1)
    for bx, by in rng.uniform(-2e-3, 8e-3, size=(20, 2)):
        fb, sb, fc, sc = detector_offsets_m(conv, bx, by, P_M, DETSIZE_S_M)
        fast, slow = (fc, sc) if conv in ("xds", "dials") else (fb, sb)
        back = beam_centre_from_offsets_m(conv, fast, slow, P_M, DETSIZE_S_M)
        np.testing.assert_allclose(back, (bx, by), rtol=0, atol=1e-18)
        again = detector_offsets_m(conv, *back, P_M, DETSIZE_S_M)
        np.testing.assert_allclose(again, (fb, sb, fc, sc), rtol=0, atol=1e-18)
        assert (fb, sb) == (fc, sc)  # one pair; the pivot derives the other
    t = torch.tensor([1.5e-3, 2.5e-3], dtype=torch.float64, requires_grad=True)
    out = detector_offsets_m(conv, t[0], t[1], torch.tensor(P_M, dtype=torch.float64), DETSIZE_S_M)
    back = torch.stack(beam_centre_from_offsets_m(conv, out[0], out[1], P_M, DETSIZE_S_M))
    assert torch.allclose(back, t, rtol=0, atol=1e-18)
    back.sum().backward()  # differentiable end to end (the simulator refines through the forward map)
    assert torch.allclose(t.grad, torch.ones(2, dtype=torch.float64))


def test_documented_rules():
    """docs/conventions.md, "Beam centre": the axis swap, the +1/2 pixel and the slow-axis flip."""
    p, x, y, ds = 0.1, 3.0, 4.0, 10.0  # mm: the functions are linear, any one length unit works
    assert detector_offsets_m("mosflm", x, y, p, ds) == (y + p / 2, x + p / 2, y + p / 2, x + p / 2)
    assert detector_offsets_m("denzo", x, y, p, ds) == (y, x, y, x)
    assert detector_offsets_m("adxv", x, y, p, ds) == (x, ds - y, x, ds - y)
    assert detector_offsets_m("xds", x, y, p, ds) == (x - p / 2, y - p / 2, x - p / 2, y - p / 2)
    assert detector_offsets_m("dials", x, y, p, ds) == detector_offsets_m("xds", x, y, p, ds)
    assert detector_offsets_m("custom", x, y, p, ds) == (x, y, x, y)
    # ORGX counts pixel centres from 1: ORGX = 1 is the centre of pixel 0, half a pixel from pix0
    assert close_from_org_m(1.0, 1e-4) == pytest.approx(0.5e-4)
    assert org_from_close_px(close_from_org_m(17.3, 2e-4), 2e-4) == pytest.approx(17.3, abs=1e-12)
    # canonical XDS beam_x is ORGX * pixel
    fc, sc, _, _ = detector_offsets_m("xds", 17.3 * 2e-4, 21.6 * 2e-4, 2e-4, 6e-3)
    assert (org_from_close_px(fc, 2e-4), org_from_close_px(sc, 2e-4)) == pytest.approx((17.3, 21.6), abs=1e-12)
    with pytest.raises(ValueError, match="unknown detector convention 'mar'"):
        detector_offsets_m("mar", x, y, p, ds)


def test_defaults():
    """MOSFLM/DENZO: (detsize + p)/2; ADXV: ((detsize_f + p)/2, (detsize_s - p)/2); others: the close point."""
    p, df, ds = 1e-4, 25.6e-3, 12.8e-3
    assert default_beam_centre_m("mosflm", p, df, ds) == ((ds + p) / 2, (df + p) / 2)
    assert default_beam_centre_m("denzo", p, df, ds) == ((ds + p) / 2, (df + p) / 2)
    assert default_beam_centre_m("adxv", p, df, ds) == ((df + p) / 2, (ds - p) / 2)
    assert default_beam_centre_m("custom", p, df, ds) == (df / 2, ds / 2)
    assert default_beam_centre_m("custom", p, df, ds, (1e-3, 2e-3)) == (1e-3, 2e-3)
    for conv in ("xds", "dials"):  # the close point is the detector centre: ORGX = fpixels/2 + 1/2
        fc, sc, _, _ = detector_offsets_m(conv, *default_beam_centre_m(conv, p, df, ds), p, ds)
        assert (fc, sc) == pytest.approx((df / 2, ds / 2), abs=1e-18)
    # MOSFLM's default puts the direct beam a full pixel past the centre of a 256-pixel detector
    fb, _, _, _ = detector_offsets_m("mosflm", *default_beam_centre_m("mosflm", p, 256 * p, 256 * p), p, 256 * p)
    assert fb / p == pytest.approx(129.0)


@pytest.mark.parametrize("conv", CONVENTIONS)
def test_flags_resolve_to_the_canonical_centre(conv):
    """beam_centre_flags -> nbtorch: the simulator's beam_x/beam_y, its geometry's offsets, where the
    direct beam really meets the detector, and the SMV header, all agree with the module."""
    bx_mm, by_mm = 3.1, 2.3
    flags = beam_centre_flags(conv, bx_mm, by_mm, 0.2)
    assert flags[0] == ("-ORGX" if conv in ("xds", "dials") else "-Xbeam")
    sim = Simulator(config_from_args(f"{SELECT[conv]} {CRYSTAL}".split() + flags), compile=False)
    s = sim.setup
    assert s.convention == conv
    assert (s.params["beam_x"], s.params["beam_y"]) == pytest.approx((bx_mm, by_mm), abs=1e-12)
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
    want = detector_offsets_m(conv, bx_mm / 1000, by_mm / 1000, s.pixel_m, s.detsize_s_m)
    got = tuple(float(v) for v in (g.Fbeam, g.Sbeam, g.Fclose, g.Sclose))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    # the direct beam meets the plane at (Fbeam, Sbeam) from pix0 (detector normal to the beam)
    t = (g.pix0 @ g.odet) / (g.beam @ g.odet)
    hit = t * g.beam - g.pix0
    np.testing.assert_allclose((float(hit @ g.fdet), float(hit @ g.sdet)), want[:2], rtol=0, atol=1e-15)
    hv = header_values(sim)
    fast, slow = want[:2]
    for other, keys in (("mosflm", ("mosflm_x", "mosflm_y")), ("denzo", ("denzo_x", "denzo_y")),
                        ("adxv", ("adxv_x", "adxv_y"))):
        expect = beam_centre_from_offsets_m(other, fast, slow, s.pixel_m, s.detsize_s_m)
        assert (hv[keys[0]], hv[keys[1]]) == pytest.approx((expect[0] * 1000, expect[1] * 1000), abs=1e-12)
    xds_canonical = beam_centre_from_offsets_m("xds", fast, slow, s.pixel_m, s.detsize_s_m)
    assert (hv["xds_orgx"], hv["xds_orgy"]) == pytest.approx(
        (xds_canonical[0] / s.pixel_m, xds_canonical[1] / s.pixel_m), abs=1e-9)


def test_header_beam_centre_written_in_every_convention(tmp_path):
    """refine.inputs.start_model: a header's direct-beam spot becomes flags that put the beam back on it."""
    from nbtorch.io import write_cbf
    from refine.inputs.images import load_image
    from refine.inputs.start_model import model_config

    spot_px = (17.25, 11.5)  # fast, slow, from the corner of pixel (0, 0)
    write_cbf(tmp_path / "x.cbf", np.zeros((30, 40), dtype=np.int32),
              {"wavelength_A": 1.0, "distance_mm": 80.0, "pixel_size_mm": 0.2,
               "beam_x_px": spot_px[0], "beam_y_px": spot_px[1]})
    obs = load_image(tmp_path / "x.cbf")
    crystal = "-cell 50 60 70 90 90 90 -N 3 -default_F 10"
    for conv in CONVENTIONS:
        cfg, tokens, notes = model_config(f"{SELECT[conv]} {crystal}", obs)
        with torch.no_grad():
            sim = Simulator(cfg, compile=False)
            g = sim.geometry(sim.parameters_dict())
        assert (float(g.Fbeam) / 0.2e-3, float(g.Sbeam) / 0.2e-3) == pytest.approx(spot_px, abs=1e-9), conv
        assert any(f"({conv} convention)" in n for n in notes)


def test_close_point_from_org_or_the_detector_centre():
    assert close_point_m(None, None, P_M, 40 * P_M, DETSIZE_S_M) == (40 * P_M / 2.0, DETSIZE_S_M / 2.0)
    assert close_point_m(12.5, None, P_M, 40 * P_M, DETSIZE_S_M) == (close_from_org_m(12.5, P_M), DETSIZE_S_M / 2.0)
    assert close_point_m(None, 3.0, P_M, 40 * P_M, DETSIZE_S_M) == (40 * P_M / 2.0, close_from_org_m(3.0, P_M))


def test_header_beam_centres_as_the_spot_from_the_corner():
    """MOSFLM_CENTER_X/Y are half a pixel short of the spot (slow, fast); DENZO_X/Y_BEAM (and ADSC's BEAM_CENTER_X/Y)
    are the spot along slow and fast; any unit."""
    assert header_beam_offsets("mosflm", 12.3, 7.25, 0.1) == (7.25 + 0.05, 12.3 + 0.05)
    assert header_beam_offsets("denzo", 12.3, 7.25, 0.1) == (7.25, 12.3)
    # the header's MOSFLM centre of a model is the model's own MOSFLM beam centre: back to the same spot
    fbeam, sbeam, _, _ = detector_offsets_m("mosflm", 0.0123, 0.00725, P_M, DETSIZE_S_M)
    assert header_beam_offsets("mosflm", 0.0123, 0.00725, P_M) == (fbeam, sbeam)
    with pytest.raises(ValueError, match="MOSFLM or DENZO"):
        header_beam_offsets("adxv", 1.0, 1.0, 0.1)
