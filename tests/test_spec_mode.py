"""Spec mode (the default) against C parity (``-c_parity``): spec does the physically right thing.

Each test renders small images in both modes and checks a physical invariant
that spec keeps and the C's quirk breaks (see ``shared/golden/INDEX.md``,
"Known C quirks").
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.physics.crystal import cell_from_vectors

F64 = torch.float64
TRICLINIC = ["-cell", "70", "80", "90", "75", "85", "95", "-misset", "10", "20", "30", "-default_F", "100",
             "-N", "5", "-lambda", "1.0"]
CUBIC = ["-cell", "100", "100", "100", "90", "90", "90", "-default_F", "100", "-N", "5", "-lambda", "6.2"]
BASE = TRICLINIC + ["-distance", "100", "-detpixels", "64", "-pixel", "0.1"]


@lru_cache(maxsize=None)
def _render(args: tuple[str, ...], c_parity: bool = False, dtype: torch.dtype = F64) -> np.ndarray:
    argv = list(args) + (["-c_parity"] if c_parity else [])
    sim = Simulator(config_from_args(argv), dtype=dtype)
    with torch.no_grad():
        return sim().double().numpy()


def image(args, c_parity=False, dtype=F64) -> np.ndarray:
    return _render(tuple(args), c_parity, dtype)


def _n_spots(img: np.ndarray, frac: float = 0.1) -> int:
    """Local maxima (3x3) above frac * max."""
    t = torch.from_numpy(img)[None, None]
    pooled = torch.nn.functional.max_pool2d(t, 3, stride=1, padding=1)
    peaks = (t == pooled) & (t > frac * t.max())
    return int(peaks.sum())


def _rel_maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(a).max(), np.abs(b).max()))


@pytest.mark.parametrize("c_parity", [False, True])
@pytest.mark.parametrize("args, min_spots", [(BASE, 5), (CUBIC + ["-distance", "100", "-detpixels", "64", "-pixel", "0.1"], 4)])
def test_images_are_non_trivial(args, min_spots, c_parity):
    img = image(args, c_parity)
    assert img.shape == (64, 64)
    assert np.isfinite(img).all() and (img >= 0).all()
    assert img.max() > 0
    assert _n_spots(img) >= min_spots
    assert (img > 0.1 * img.max()).sum() >= 20
    assert img.max() > 10.0 * np.median(img)


def test_modes_agree_where_no_quirk_applies():
    """Cubic cell, one sub-pixel, one source, one phi step: spec and C parity are the same physics."""
    args = CUBIC + ["-distance", "100", "-detpixels", "64", "-pixel", "0.1", "-oversample", "1"]
    assert _rel_maxdiff(image(args), image(args, True)) < 1e-12


# (1) phi = 0 carryover ---------------------------------------------------------------------
def test_phi_zero_is_continuous_in_spec_only():
    osc = ["-osc", "1", "-phisteps", "5"]
    spec0 = image(BASE + ["-phi", "0"] + osc)
    spec_eps = image(BASE + ["-phi", "1e-12"] + osc)
    c0 = image(BASE + ["-phi", "0"] + osc, True)
    c_eps = image(BASE + ["-phi", "1e-12"] + osc, True)
    assert _n_spots(spec0) >= 5
    # spec: rotating by 0 is the identity, so phi0 = 0 and phi0 = 1e-12 give the same image
    assert _rel_maxdiff(spec0, spec_eps) < 1e-9
    # C: the phi = 0 step reuses the previous evaluation's last rotation (0.8 deg)
    assert _rel_maxdiff(c0, c_eps) > 0.01
    # and the phi = 1e-12 C image is continuous with its own neighbour
    assert _rel_maxdiff(c_eps, image(BASE + ["-phi", "2e-12"] + osc, True)) < 1e-9


def test_phi_carryover_keeps_the_mosaic_axis():
    """C parity, phi 0 with 4 steps and 5 mosaic domains, per pixel.  No golden case has both (the C program is not
    built here), so the image is checked against its own decomposition: the C's pixel is the mean over phi steps of
    one-step images with the same domains, and the step at phi 0 re-uses the *rotation* of the last step (0.75 deg)
    with every domain's own mosaic matrix applied after it (a = U_m R_phi a0), not one domain's vectors.  Pixel
    (0, 0) (oversample 1: its one evaluation is the image's first) sees the un-rotated crystal instead.  Each of
    those one-step images is C parity checked elsewhere (golden cases mosaic, phi_osc_*); acceptance 1e-6 relative
    to each pixel, every pixel non-zero."""
    args = BASE + ["-oversample", "1", "-mosaic", "0.5", "-mosaic_dom", "5", "-mosaic_seed", "12345"]

    def one_step(phi: str, domains: list[str] = ()) -> np.ndarray:
        return image(args + ["-phi", phi, "-osc", "0.25", "-phisteps", "1"] + list(domains), True)

    full = image(args + ["-phi", "0", "-osc", "1", "-phisteps", "4"], True)
    steps = {phi: one_step(phi) for phi in ("0", "0.25", "0.5", "0.75")}
    expected = (2.0 * steps["0.75"] + steps["0.25"] + steps["0.5"]) / 4.0
    expected[0, 0] = sum(s[0, 0] for s in steps.values()) / 4.0
    assert _n_spots(full) >= 5 and (expected > 0).all()
    rel = np.abs(full - expected) / expected
    worst = np.unravel_index(rel.argmax(), rel.shape)
    assert rel.max() <= 1e-6, f"pixel (slow, fast) {worst}: {full[worst]!r} vs {expected[worst]!r}"
    # the domains matter here: a phi-0 step without them (one crystal orientation) is far off
    collapsed = expected + (one_step("0.75", ["-mosaic_dom", "1"]) - steps["0.75"]) / 4.0
    assert _rel_maxdiff(full, collapsed) > 1e-3


# (2) -oversample_omega ------------------------------------------------------------------------
def test_oversample_omega_spec_is_physical():
    args = BASE + ["-oversample", "3"]
    spec = image(args)
    spec_om = image(args + ["-oversample_omega"])
    c = image(args, True)
    c_om = image(args + ["-oversample_omega"], True)
    # spec already integrates the solid angle per sub-pixel: the flag changes nothing beyond a few %
    assert abs(spec_om.sum() / spec.sum() - 1.0) < 0.03
    assert _rel_maxdiff(spec_om, spec) < 0.03
    # spec per-sub-pixel omega is close to the C's per-pixel omega without the flag
    assert abs(spec.sum() / c.sum() - 1.0) < 0.03
    # C: the running sum is multiplied by omega after every term (~0.11x)
    ratio = c_om.sum() / c.sum()
    assert 0.05 < ratio < 0.2


# (3) water background ---------------------------------------------------------------------------
WATER = ["-cell", "70", "80", "90", "75", "85", "95", "-default_F", "0", "-N", "5", "-lambda", "1.0",
         "-distance", "100", "-detpixels", "32", "-pixel", "0.1", "-water", "0.2"]


def _water(fluence: str, oversample: str, c_parity: bool) -> np.ndarray:
    return image(WATER + ["-fluence", fluence, "-oversample", oversample], c_parity)


def test_water_background_linear_in_fluence_and_sampling_independent():
    base = _water("1e24", "1", False)
    assert base.min() > 0 and np.isfinite(base).all()
    # smooth background, no spots (F = 0)
    assert base.max() / base.min() < 1.01
    np.testing.assert_allclose(_water("2e24", "1", False), 2.0 * base, rtol=1e-12)
    np.testing.assert_allclose(_water("1e24", "2", False), base, rtol=0.01)
    # the C seeds the running sum with r_e^2 fluence I_bg: quadratic in fluence, divided by steps
    cbase = _water("1e24", "1", True)
    np.testing.assert_allclose(_water("2e24", "1", True), 4.0 * cbase, rtol=1e-12)
    np.testing.assert_allclose(_water("1e24", "2", True), cbase / 4.0, rtol=0.01)
    # the physical value: r_e^2 fluence F_bg^2 N_water omega P (spec) vs r_e^2 fluence times that (C)
    r_e2_fluence = 7.94079248018965e-30 * 1e24
    np.testing.assert_allclose(cbase / base, r_e2_fluence, rtol=1e-3)


# (4) detector thickness --------------------------------------------------------------------------
THICK = TRICLINIC + ["-distance", "50", "-detpixels", "48", "-pixel", "0.1", "-oversample", "1",
                     "-detector_thick", "100", "-detector_abs", "50"]


def test_thickness_converges_with_thicksteps_in_spec_only():
    spec = {n: image(THICK + ["-thicksteps", str(n)]) for n in (2, 8)}
    cpar = {n: image(THICK + ["-thicksteps", str(n)], True) for n in (2, 8)}
    thin = image(TRICLINIC + ["-distance", "50", "-detpixels", "48", "-pixel", "0.1", "-oversample", "1"])
    assert _n_spots(spec[8]) >= 3
    # spec: layer sampling refines the depth integral, the captured total barely moves
    assert abs(spec[2].sum() / spec[8].sum() - 1.0) < 0.005
    assert _rel_maxdiff(spec[2], spec[8]) < 0.03
    # and the total capture is 1 - exp(-thick mu) (parallax ~ 1 near the beam) of the thin image
    assert spec[8].sum() / thin.sum() == pytest.approx(1.0 - math.exp(-2.0), rel=0.01)
    # C: sum over layers times the last layer's capture, with n layers spanning thick n/(n-1)
    assert abs(cpar[2].sum() / cpar[8].sum() - 1.0) > 0.1
    assert cpar[8].sum() / thin.sum() < 0.5


def _parallax(args) -> np.ndarray:
    sim = Simulator(config_from_args(args), dtype=F64)
    g = sim.geometry(sim.parameters_dict())
    ny, nx = sim.shape
    p = sim.setup.pixel_m
    j, i = torch.meshgrid(torch.arange(ny, dtype=F64), torch.arange(nx, dtype=F64), indexing="ij")
    pos = g.pix0 + ((i + 0.5) * p)[..., None] * g.fdet + ((j + 0.5) * p)[..., None] * g.sdet
    return (pos / pos.norm(dim=-1, keepdim=True) @ g.odet).numpy()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_capture_fractions_sum_to_absorbed_fraction(n):
    """Smooth image (N = 1: F_latt = 1) and a sensor much thinner than the distance.

    Spec: image(thick) / image(thin) = sum over layers of the capture fractions
    = 1 - exp(-thick mu / parallax), whatever the number of layers.
    """
    smooth = ["-cell", "70", "80", "90", "75", "85", "95", "-default_F", "100", "-N", "1", "-lambda", "1.0",
              "-distance", "20", "-detpixels", "32", "-pixel", "0.5", "-oversample", "1"]
    thick = ["-detector_thick", "1", "-detector_abs", "0.5", "-thicksteps", str(n)]  # thick * mu = 2
    rho = _parallax(smooth)
    assert rho.min() < 0.9  # a wide angular range, so the parallax matters
    want = 1.0 - np.exp(-2.0 / rho)
    ratio = image(smooth + thick) / image(smooth)
    np.testing.assert_allclose(ratio, want, rtol=2e-4)
    if n >= 2:
        # C parity: n layers of thick/(n-1); the sum of n layers times the capture of the last one
        dz = 2.0 / (n - 1)
        c_want = n * (np.exp(-(n - 1) * dz / rho) - np.exp(-n * dz / rho))
        c_ratio = image(smooth + thick, True) / image(smooth, True)
        np.testing.assert_allclose(c_ratio, c_want, rtol=2e-4)
        assert np.abs(c_ratio / want - 1.0).max() > 0.1


# (5) triclinic cell -------------------------------------------------------------------------------
def test_triclinic_cell_exact_in_spec_distorted_in_c_parity():
    angles = {}
    for c_parity in (False, True):
        sim = Simulator(config_from_args(BASE + (["-c_parity"] if c_parity else [])), dtype=F64)
        real, recip = sim.crystal(sim.parameters_dict())
        cell = cell_from_vectors(real[0, 0]).numpy()
        np.testing.assert_allclose(cell[:3], [70.0, 80.0, 90.0], atol=1e-9)
        angles[c_parity] = np.degrees(cell[3:])
        # the reciprocal basis returned with the lattice is dual to it in both modes' own sense
        assert torch.allclose(real[0, 0] @ recip.T, torch.eye(3, dtype=F64), atol=1e-9 if not c_parity else 1e-3)
    np.testing.assert_allclose(angles[False], [75.0, 85.0, 95.0], atol=1e-9)
    np.testing.assert_allclose(angles[True], [75.0391, 85.0136, 95.0081], atol=1e-3)
    # the images differ because the lattices do
    assert _rel_maxdiff(image(BASE), image(BASE, True)) > 1e-3


# (6) float32 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [BASE, BASE + ["-round_xtal"], BASE + ["-oversample", "3", "-polar", "0.5"]])
def test_float32_matches_float64_spec(args):
    a64 = image(args)
    a32 = image(args, dtype=torch.float32)
    assert _n_spots(a64) >= 5
    corr = np.corrcoef(a64.ravel(), a32.ravel())[0, 1]
    assert corr >= 0.99999
    assert abs(a32.sum() / a64.sum() - 1.0) < 1e-4


def test_phi_carryover_mode_alias():
    """-phi_carryover_mode selects the phi=0 behaviour on its own (the seeds' name for the quirk)."""
    import torch as _torch

    from nbtorch import Simulator as _Sim, config_from_args as _cfa

    # an orthorhombic cell: spec and C parity differ only by the phi quirk here
    base = ("-cell 70 80 90 90 90 90 -misset 10 20 30 -N 5 -lambda 1 -default_F 100 -distance 100 "
            "-detpixels 32 -pixel 0.8 -oversample 1 -phi 0 -osc 1 -phisteps 5").split()

    def img(*extra):
        return _Sim(_cfa(base + list(extra)), dtype=_torch.float64, compile=False)()

    spec, quirk = img(), img("-c_parity")
    assert not _torch.allclose(spec, quirk)
    assert _torch.allclose(img("-phi_carryover_mode", "c-parity"), img("-c_parity", "-phi_carryover_mode", "c-parity"), rtol=1e-12, atol=0)
    assert _torch.allclose(img("-phi_carryover_mode", "c-parity"), quirk, rtol=1e-12, atol=0)
    assert _torch.equal(img("-c_parity", "-phi_carryover_mode", "spec"), img("-c_parity", "-phi", "0", "-phi_carryover_mode", "spec"))
    assert _torch.allclose(img("-c_parity", "-phi_carryover_mode", "spec"), spec, rtol=1e-12, atol=0)
