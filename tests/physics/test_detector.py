"""Detector geometry: pix0 and bases against the C traces, pivot invariants, gradients."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.physics.detector import flat_subpixel_components, subpixel_positions
from nbtorch.physics.kernel import position_components
from nbtorch.physics.rotation import rotation_matrix_xyz

DT = torch.float64
from golden import GOLDEN, MISSING
CUBIC = ["-cell", "100", "100", "100", "90", "90", "90", "-default_F", "100", "-N", "5", "-lambda", "6.2"]
ROT_CASES = [
    {"detector_rotx": 1.0, "detector_roty": 2.0, "detector_rotz": 3.0},
    {"twotheta": 4.0},
    {"detector_rotx": -5.0, "detector_roty": 3.0, "detector_rotz": 10.0, "twotheta": 20.0},
    {"detector_roty": 30.0},
]


def _sim(args: list[str]) -> Simulator:
    return Simulator(config_from_args(args), dtype=DT)


def _geom(sim: Simulator, **overrides):
    return sim.geometry(sim.parameters_dict(**overrides))


def _true_beam_spot(g) -> tuple[float, float, float]:
    """Where the direct beam meets the detector plane: (F, S) from pix0 and the beam path length (m)."""
    t = (g.pix0 @ g.odet) / (g.beam @ g.odet)
    hit = t * g.beam - g.pix0
    return float(hit @ g.fdet), float(hit @ g.sdet), float(t)


def test_mosflm_documented_pix0():
    sim = _sim(CUBIC + ["-detpixels", "1024", "-pixel", "0.1", "-distance", "100", "-Xbeam", "51.2", "-Ybeam", "51.2"])
    g = _geom(sim)
    np.testing.assert_allclose(g.pix0.numpy(), [0.1, 0.05125, -0.05125], rtol=0, atol=1e-15)
    np.testing.assert_allclose(g.fdet.numpy(), [0, 0, 1], atol=0)
    np.testing.assert_allclose(g.sdet.numpy(), [0, -1, 0], atol=0)
    np.testing.assert_allclose(g.odet.numpy(), [1, 0, 0], atol=0)
    assert float(g.Fbeam) == pytest.approx(0.05125, abs=1e-15)
    assert float(g.Sbeam) == pytest.approx(0.05125, abs=1e-15)
    assert float(g.distance) == pytest.approx(0.1, abs=1e-15)
    # the same in C-parity mode
    g2 = _geom(_sim(CUBIC + ["-detpixels", "1024", "-pixel", "0.1", "-distance", "100", "-Xbeam", "51.2", "-Ybeam", "51.2", "-c_parity"]))
    assert torch.equal(g.pix0, g2.pix0)


def test_pixel_centres_from_pix0():
    """Pixel (slow j, fast i) centre = pix0 + (i + 1/2) p f + (j + 1/2) p s; sub-pixels average to it."""
    sim = _sim(CUBIC + ["-detpixels", "32", "-pixel", "0.1", "-distance", "100"])
    g = _geom(sim)
    p = torch.tensor(1e-4, dtype=DT)
    fast = torch.tensor([0, 5, 31])
    slow = torch.tensor([0, 7, 2])
    one = subpixel_positions(g, fast, slow, p, 1, torch.zeros(1, dtype=DT))[:, 0, 0]
    want = g.pix0 + (fast.to(DT) + 0.5)[:, None] * p * g.fdet + (slow.to(DT) + 0.5)[:, None] * p * g.sdet
    assert torch.allclose(one, want, atol=1e-16, rtol=0)
    three = subpixel_positions(g, fast, slow, p, 3, torch.zeros(1, dtype=DT))[:, 0]
    assert three.shape == (3, 9, 3)
    assert torch.allclose(three.mean(1), want, atol=1e-16, rtol=0)
    # slow-major sub-pixel order: the second sub-pixel steps along fast
    assert torch.allclose(three[:, 1] - three[:, 0], (p / 3) * g.fdet.expand(3, 3), atol=1e-16)
    assert torch.allclose(three[:, 3] - three[:, 0], (p / 3) * g.sdet.expand(3, 3), atol=1e-16)


def test_flat_components_are_the_positions():
    """The component layout the kernel uses gives exactly subpixel_positions' numbers (T layers, S sub-pixels)."""
    sim = _sim(CUBIC + ["-detpixels", "32", "-pixel", "0.1", "-distance", "100", "-twotheta", "7"])
    g = _geom(sim)
    p = torch.tensor(1e-4, dtype=DT)
    fast, slow = torch.tensor([0, 5, 31, 2]), torch.tensor([0, 7, 2, 31])
    layers = torch.tensor([0.0, 1e-5, 3e-5], dtype=DT)
    pos = subpixel_positions(g, fast, slow, p, 3, layers)  # (P, T, S, 3)
    comps = flat_subpixel_components(g, fast, slow, p, 3, layers)  # 3 x (T, S, P)
    assert all(c.shape == (3, 9, 4) for c in comps)
    for c, got in enumerate(comps):
        assert torch.equal(got, pos[..., c].permute(1, 2, 0))
    assert all(torch.equal(a, b) for a, b in zip(position_components(pos), comps))


def _read_trace(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts and parts[0] in ("DETECTOR_FAST_AXIS", "DETECTOR_SLOW_AXIS", "DETECTOR_NORMAL_AXIS", "DETECTOR_PIX0_VECTOR"):
            out[parts[0]] = np.array([float(x) for x in parts[1:4]])
    return out


TRACE_CASES = sorted(p.parent.name for p in GOLDEN.glob("*/geometry_trace.txt")) if GOLDEN.is_dir() else []


@pytest.mark.skipif(not TRACE_CASES, reason=MISSING if not GOLDEN.is_dir() else f"no golden geometry traces under {GOLDEN}")
def test_geometry_matches_c_traces():
    checked = 0
    failures = []
    old = os.getcwd()
    for case in TRACE_CASES:
        folder = GOLDEN / case
        trace = _read_trace(folder / "geometry_trace.txt")
        assert len(trace) == 4, f"{case}: trace format changed ({sorted(trace)})"
        os.chdir(folder)  # args name input files (P1.hkl, A.mat, sources.txt) relative to the case
        try:
            sim = Simulator(config_from_args((folder / "args.txt").read_text().split() + ["-c_parity"]), dtype=DT)
            g = _geom(sim)
        finally:
            os.chdir(old)
        for key, vec in (("DETECTOR_PIX0_VECTOR", g.pix0), ("DETECTOR_FAST_AXIS", g.fdet),
                         ("DETECTOR_SLOW_AXIS", g.sdet), ("DETECTOR_NORMAL_AXIS", g.odet)):
            err = np.abs(vec.numpy() - trace[key]).max()
            if not err <= 1e-12:
                failures.append(f"{case} {key}: ours {vec.numpy()} C {trace[key]} (|diff| {err:.3g})")
        checked += 1
    assert not failures, "\n".join(failures)
    assert checked == len(TRACE_CASES) >= 1


@pytest.mark.parametrize("rot", ROT_CASES)
@pytest.mark.parametrize("conv", [[], ["-adxv"], ["-denzo"]])
def test_beam_pivot_keeps_direct_beam_spot(rot, conv):
    sim = _sim(CUBIC + ["-detpixels", "64", "-pixel", "0.1", "-distance", "80"] + conv)
    assert sim.setup.pivot == "beam"
    g0 = _geom(sim)
    f0, s0, t0 = _true_beam_spot(g0)
    assert (f0, s0) == pytest.approx((float(g0.Fbeam), float(g0.Sbeam)), abs=1e-15)
    g = _geom(sim, **rot)
    f, s, t = _true_beam_spot(g)
    assert f == pytest.approx(f0, abs=1e-14)
    assert s == pytest.approx(s0, abs=1e-14)
    assert t == pytest.approx(0.08, abs=1e-14)  # the beam path length is the -distance
    # bases stay orthonormal and right-handed
    m = torch.stack((g.fdet, g.sdet, g.odet))
    assert torch.allclose(m @ m.T, torch.eye(3, dtype=DT), atol=1e-14)
    assert torch.linalg.det(m) == pytest.approx(float(torch.linalg.det(torch.stack((g0.fdet, g0.sdet, g0.odet)))), abs=1e-14)
    # the detector did move
    assert (g.pix0 - g0.pix0).abs().max() > 1e-5 and (g.odet - g0.odet).abs().max() > 1e-3


@pytest.mark.parametrize("rot", [r for r in ROT_CASES if "twotheta" not in r])
def test_beam_pivot_reported_fbeam_unchanged_without_twotheta(rot):
    sim = _sim(CUBIC + ["-detpixels", "64", "-pixel", "0.1", "-distance", "80"])
    g0, g = _geom(sim), _geom(sim, **rot)
    assert float(g.Fbeam) == pytest.approx(float(g0.Fbeam), abs=1e-14)
    assert float(g.Sbeam) == pytest.approx(float(g0.Sbeam), abs=1e-14)
    assert float(g.distance) == pytest.approx(0.08, abs=1e-14)


@pytest.mark.parametrize("rot", ROT_CASES)
@pytest.mark.parametrize("conv", [["-xds", "-ORGX", "20.5", "-ORGY", "40.25"], ["-dials"],
                                  ["-fdet_vector", "0", "0", "1", "-sdet_vector", "0", "-1", "0", "-pivot", "sample"]])
def test_sample_pivot_keeps_near_point(rot, conv):
    sim = _sim(CUBIC + ["-detpixels", "64", "-pixel", "0.1", "-distance", "80"] + conv)
    assert sim.setup.pivot == "sample"
    g0 = _geom(sim)
    g = _geom(sim, **rot)
    assert float(g.Fclose) == pytest.approx(float(g0.Fclose), abs=1e-14)
    assert float(g.Sclose) == pytest.approx(float(g0.Sclose), abs=1e-14)
    # the canonical distance is the beam path: close = |beam . o'| distance, o' rotated by rotx/y/z only
    deg = np.pi / 180.0
    r = rotation_matrix_xyz(*(torch.tensor(rot.get(k, 0.0) * deg, dtype=DT)
                              for k in ("detector_rotx", "detector_roty", "detector_rotz")))
    o1 = r @ torch.tensor(sim.setup.odet, dtype=DT)
    assert float(g.close_distance) == pytest.approx(0.08 * abs(float(g.beam @ o1)), abs=1e-14)
    if set(rot) == {"twotheta"}:
        assert float(g.close_distance) == pytest.approx(float(g0.close_distance), abs=1e-14)
    # the near point is the foot of the perpendicular: pix0 + Fclose f + Sclose s is along the normal
    foot = g.pix0 + g.Fclose * g.fdet + g.Sclose * g.sdet
    assert torch.allclose(torch.linalg.cross(foot, g.odet, dim=-1), torch.zeros(3, dtype=DT), atol=1e-15)
    # while the direct-beam spot moves
    f0, s0, _ = _true_beam_spot(g0)
    f, s, _ = _true_beam_spot(g)
    assert max(abs(f - f0), abs(s - s0)) > 1e-5


def test_xds_orgx_sets_near_point():
    sim = _sim(CUBIC + ["-detpixels", "64", "-pixel", "0.1", "-distance", "80", "-xds", "-ORGX", "20.5", "-ORGY", "40.25"])
    g = _geom(sim)
    assert float(g.Fclose) == pytest.approx(20.0e-4, abs=1e-15)
    assert float(g.Sclose) == pytest.approx(39.75e-4, abs=1e-15)


@pytest.mark.parametrize("extra", [[], ["-xds"], ["-detector_rotx", "3", "-detector_roty", "-2", "-twotheta", "5"]])
def test_gradcheck_pix0_wrt_distance_and_beam_centre(extra):
    sim = _sim(CUBIC + ["-detpixels", "64", "-pixel", "0.1", "-distance", "80"] + extra)
    d = torch.tensor(80.0, dtype=DT, requires_grad=True)
    bx = torch.tensor(3.1, dtype=DT, requires_grad=True)
    by = torch.tensor(2.9, dtype=DT, requires_grad=True)

    def pix0(dd, xx, yy):
        return _geom(sim, distance=dd, beam_x=xx, beam_y=yy).pix0 * 1000.0  # mm

    assert torch.autograd.gradcheck(pix0, (d, bx, by))
    if not extra:
        # MOSFLM, BEAM pivot: d pix0 / d distance = beam, d pix0 / d Xbeam = -sdet (Xbeam runs along slow)
        jd, jx, jy = torch.autograd.functional.jacobian(pix0, (d, bx, by))
        g = _geom(sim)
        assert torch.allclose(jd, g.beam, atol=1e-14)
        assert torch.allclose(jx, -g.sdet, atol=1e-14)
        assert torch.allclose(jy, -g.fdet, atol=1e-14)


def test_gradcheck_pix0_wrt_rotations():
    sim = _sim(CUBIC + ["-detpixels", "64", "-pixel", "0.1", "-distance", "80"])
    angles = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DT, requires_grad=True)

    def fn(a):
        g = _geom(sim, detector_rotx=a[0], detector_roty=a[1], detector_rotz=a[2], twotheta=a[3])
        return torch.cat((g.pix0 * 1000.0, g.fdet, g.sdet, g.odet))

    assert torch.autograd.gradcheck(fn, (angles,))
