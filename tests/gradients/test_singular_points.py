"""Singular points: gradients are finite there and equal to their limits.

* exact Bragg condition: h, k, l integer, where sin(N pi h)/sin(pi h) is 0/0 (the
  direct-beam pixel has h = k = l = 0 exactly; the lattice functions are also
  checked directly at integer and half-integer indices);
* zero mosaic spread (all domains at the identity), zero rotations (misset, phi,
  orientation deltas, detector), 90 degree cells (spec and the C-parity c*_z formula),
  N = 1 (no interference along that axis), a pixel on the direct beam;
* at each: no NaN or Inf in any ``.grad`` (all canonical parameters, the orientation
  deltas and the structure-factor table), autograd == a central finite difference
  straddling the point, and the one-sided gradients ``g(x* +- delta)`` converge to
  ``g(x*)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from gradient_probes import get_probe, one_thread_eager  # noqa: F401  (autouse fixture)
from nbtorch import PARAMETER_NAMES, Simulator, config_from_args
from nbtorch.tools.gradcheck_report import ALL_PARAMS, CASES, ORIENTATION_DELTAS, PROBED_NAMES, direct_beam_pixel
from nbtorch.physics.detector import subpixel_positions
from nbtorch.physics.lattice import lattice_factor, nearest_index, sincg

DT = torch.float64
ROTATIONS = ("misset_x", "misset_y", "misset_z", "phi0", "detector_rotx", "detector_roty", "detector_rotz",
             "twotheta") + ORIENTATION_DELTAS

# name -> (case, overrides at the singular point, parameters that cross it)
POINTS = {
    "exact_bragg_direct_beam": ("direct_beam", {}, ("beam_x", "beam_y", "distance")),
    "zero_mosaic_spread": ("mosaic", {"mosaic_spread": 0.0}, ("mosaic_spread",)),
    "zero_rotations": ("mosaic", {"misset_x": 0.0, "misset_y": 0.0, "misset_z": 0.0, "phi0": 0.0}, ROTATIONS),
    "zero_rotations_xds": ("xds_sample", {"misset_x": 0.0, "misset_y": 0.0, "misset_z": 0.0, "phi0": 0.0,
                                          "detector_rotx": 0.0, "detector_roty": 0.0, "detector_rotz": 0.0,
                                          "twotheta": 0.0}, ROTATIONS),
    "cell_90": ("mosaic", {"cell_alpha": 90.0, "cell_beta": 90.0, "cell_gamma": 90.0},
                ("cell_alpha", "cell_beta", "cell_gamma", "cell_a")),
    "cell_90_c_parity": ("c_parity", {"cell_alpha": 90.0, "cell_beta": 90.0, "cell_gamma": 90.0},
                         ("cell_alpha", "cell_beta", "cell_gamma", "cell_a")),
    "N_a_1": ("mosaic", {"N_a": 1.0}, ("N_a", "cell_a", "N_b")),
    "N_1_round": ("round", {"N_a": 1.0, "N_b": 1.0, "N_c": 1.0}, ("N_a", "N_b", "N_c")),
    "N_1_gauss": ("gauss", {"N_a": 1.0, "N_b": 1.0, "N_c": 1.0}, ("N_a", "N_b", "N_c")),
    "everything_direct_beam": ("direct_beam", {"mosaic_spread": 0.0, "N_a": 1.0, "polarization": 0.0},
                               ("beam_x", "beam_y", "mosaic_spread", "N_a", "misset_x", "detector_rotx")),
}
CROSSINGS = [(p, n) for p, (_, _, names) in POINTS.items() for n in names]
OFF_DIAGONAL = ("N_d", "N_e", "N_f")


def _leaf_grads(probe, at: dict[str, float]) -> dict[str, torch.Tensor]:
    """``.grad`` of every parameter (and the table) after one backward at the point."""
    point = probe.point(at)
    leaves = {n: torch.tensor(point[n], dtype=DT, requires_grad=True) for n in probe.names}
    if probe.sim.F_grid is not None:
        leaves["F_grid"] = probe.sim.F_grid.detach().clone().requires_grad_(True)
    probe.loss(**leaves).backward()
    # a name the model does not use (the anisotropic spreads of an isotropic mosaic) has no .grad: 0
    return {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in leaves.items()}


@pytest.mark.parametrize("point", list(POINTS))
def test_no_nan_or_inf_in_any_grad(point):
    case, at, _ = POINTS[point]
    probe = get_probe(case)
    grads = _leaf_grads(probe, at)
    for name, g in grads.items():
        assert g is not None, f"{point}: {name} got no gradient"
        assert torch.isfinite(g).all(), f"{point}: {name}.grad = {g}"
    assert any(float(g.abs().max()) > 0 for g in grads.values())


@pytest.mark.parametrize("point,name", CROSSINGS)
def test_gradient_at_singular_point_matches_finite_difference(point, name):
    case, at, _ = POINTS[point]
    probe = get_probe(case)
    g = probe.autograd([name], at=at)[name]
    fd = probe.finite_difference(name, at=at)
    assert math.isfinite(g)
    assert abs(g - fd.value) <= 1e-9 + 1e-6 * abs(fd.value), f"{point}/{name}: {g!r} vs FD {fd}"


@pytest.mark.parametrize("point,name", CROSSINGS)
def test_gradient_equals_its_limits(point, name):
    """g(x* +- delta) -> g(x*): the one-sided gradients converge linearly (slope = the
    second derivative, itself finite at x*)."""
    case, at, _ = POINTS[point]
    probe = get_probe(case)
    x0 = probe.point(at)[name]
    fn, (x,), _ = probe.gradcheck_inputs([name], at=at)

    def grad_and_curvature(value):
        xv = torch.tensor(value / ALL_PARAMS[name].scale, dtype=DT, requires_grad=True)
        (g,) = torch.autograd.grad(fn(xv)[0], xv, create_graph=True)
        (c,) = torch.autograd.grad(g, xv)
        return float(g.detach()), float(c)

    g0, c0 = grad_and_curvature(x0)
    assert math.isfinite(g0) and math.isfinite(c0)
    for delta in (1e-6, 1e-8):
        for sign in (1.0, -1.0):
            gd, _ = grad_and_curvature(x0 + sign * delta * ALL_PARAMS[name].scale)
            expected = g0 + sign * delta * c0
            assert abs(gd - expected) <= 1e-7 * (abs(g0) + 1.0) * delta / 1e-6 + 1e-12, (
                f"{point}/{name}: g(x*{sign * delta:+g}) = {gd!r}, g(x*) = {g0!r}, g' = {c0!r}")


# ---------------------------------------------------------------------------------------
# the direct-beam pixel: h = k = l = 0 exactly
# ---------------------------------------------------------------------------------------
def test_direct_beam_pixel_has_exactly_zero_indices():
    sim = get_probe("direct_beam").sim
    f, s = direct_beam_pixel(sim)
    with torch.no_grad():
        p = sim.parameters_dict()
        geom = sim.geometry(p)
        pos = subpixel_positions(geom, torch.tensor([f]), torch.tensor([s]), torch.tensor(sim.setup.pixel_m, dtype=DT),
                                 sim.setup.oversample, torch.zeros(1, dtype=DT))
        d = pos / torch.linalg.vector_norm(pos, dim=-1, keepdim=True)
        scatter = (d[..., None, :] - torch.as_tensor(sim.setup.incident, dtype=DT)) / p["wavelength"]
        real, _ = sim.crystal(p)
        hkl = torch.einsum("...j,pmij->...pmi", scatter, real)
    assert sim.setup.oversample == 1
    assert torch.equal(hkl, torch.zeros_like(hkl)), hkl  # sincg is 0/0 in all three indices


@pytest.mark.parametrize("name", ["beam_x", "beam_y"])
def test_direct_beam_pixel_gradcheck_and_gradgradcheck(name):
    """The single direct-beam pixel as a function of the beam centre: the beam crosses the
    pixel centre (h = k = l = 0) within the finite-difference step."""
    probe = get_probe("direct_beam")
    f, s = direct_beam_pixel(probe.sim)
    x = torch.tensor(probe.base[name], dtype=DT, requires_grad=True)

    def pixel(v):
        img, _ = probe.sim.render(roi=(f, f, s, s), **{name: v})
        return img.reshape(1) / probe.signal.peak

    assert float(pixel(x.detach())) > 0.5  # the brightest pixel: the (000) reflection
    assert gradcheck(pixel, (x,), eps=1e-6, atol=1e-9, rtol=1e-5)
    assert gradgradcheck(pixel, (x,), eps=1e-6, atol=1e-7, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# the lattice functions at integer and half-integer indices
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1.0, 2.0, 5.0, 5.5, 40.0])
@pytest.mark.parametrize("shape", ["square", "round", "gauss"])
def test_lattice_factor_smooth_at_integer_indices(shape, n):
    """At h, k, l integer (and mixes with non-integers) F_latt is smooth in hkl and N:
    gradcheck and gradgradcheck pass with steps straddling the integer."""
    recip = torch.tensor([[0.014, 0.0, 0.0], [0.002, 0.0125, 0.0], [0.001, 0.0015, 0.011]], dtype=DT)
    hkl = torch.tensor([[0.0, 0.0, 0.0], [3.0, -2.0, 7.0], [3.0, 0.2, -1.3], [-4.0, 5.0, 0.45]],
                       dtype=DT, requires_grad=True)
    ncell = torch.tensor([n, 3.0, 2.0], dtype=DT, requires_grad=True)

    def f(h, nc):
        return lattice_factor(h, nearest_index(h.detach()), nc, shape, recip)

    out = f(hkl, ncell)
    assert torch.isfinite(out).all()
    assert gradcheck(f, (hkl, ncell), eps=1e-6, atol=1e-8, rtol=1e-6)
    assert gradgradcheck(f, (hkl, ncell), eps=1e-6, atol=1e-6, rtol=1e-5)
    # at the exact lattice point the peak is Na Nb Nc and d F_latt / d N_a = Nb Nc
    peak = f(hkl[:1], ncell)
    (gn,) = torch.autograd.grad(peak.sum(), ncell)
    nn = ncell.detach()
    prefactor = 0.723601254558268 if shape == "round" else 1.0
    assert float(peak.detach()) == pytest.approx(float(nn.prod()) * prefactor)
    if shape == "square":
        assert torch.allclose(gn, torch.stack([nn[1] * nn[2], nn[0] * nn[2], nn[0] * nn[1]]), rtol=1e-14)


@pytest.mark.parametrize("n", [1.0, 2.0, 3.0, 5.0])
def test_square_lattice_half_integer_is_smooth_for_integer_N(n):
    """At h = k + 1/2 the nearest lattice point jumps; for integer N the squared square-shape
    factor is periodic in h, so its value and derivative are continuous there, and the
    derivative at exactly k + 1/2 (ties go down: h0 = k) equals both one-sided limits."""
    ncell = torch.tensor([n, n, n], dtype=DT)

    def intensity(h):
        hkl = torch.stack([h, torch.zeros_like(h) + 0.1, torch.zeros_like(h) - 0.2], -1)
        return lattice_factor(hkl, nearest_index(hkl.detach()), ncell, "square") ** 2

    for k in (-3.0, 0.0, 2.0):
        for dx in (0.0, 1e-9, -1e-9):
            h = torch.tensor([k + 0.5 + dx], dtype=DT, requires_grad=True)
            (g,) = torch.autograd.grad(intensity(h).sum(), h)
            assert torch.isfinite(g).all()
            assert abs(float(g)) < 1e-6 * n**6, (k, dx, float(g))  # derivative of sin^2(N pi h)/... is 0 there


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("n", [1.0, 2.0, 5.0, 5.5, 20.0, 100.0])
def test_sincg_derivative_is_accurate_near_the_bragg_condition(n, dtype, rtol):
    """d/d delta of sin(n delta)/sin(delta) against 40-digit arithmetic, from delta = 1e-7 to pi/2.

    Regression: autograd through the closed form cancels (error ~6 eps/((n^2-1) delta^2)); it
    was off by up to 100 % in float32 (2e-7 in float64) just outside the old 1e-4 series."""
    mpmath = pytest.importorskip("mpmath")
    deltas = [1e-7, 1e-5, 9.9e-5, 1.01e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.2 / n, 0.1, 0.3, 1.0, 1.5]
    d = torch.tensor(deltas + [-x for x in deltas], dtype=dtype, requires_grad=True)
    nn = torch.tensor(n, dtype=dtype, requires_grad=True)
    gd, gn = torch.autograd.grad(sincg(d, nn).sum(), (d, nn))
    with mpmath.workdps(40):
        N = mpmath.mpf(n)
        f = lambda x: mpmath.sin(N * x) / mpmath.sin(x)  # noqa: E731
        for x, g in zip(d.detach().double().tolist(), gd.double().tolist()):
            want = float(mpmath.diff(f, mpmath.mpf(x)))
            # relative to the derivative, floored at 1e-3 of the spot's curvature scale n^3
            assert abs(g - want) <= rtol * max(abs(want), 1e-3 * n**3), (n, x, g, want)
        want_n = sum(float(mpmath.diff(lambda m: mpmath.sin(m * mpmath.mpf(x)) / mpmath.sin(mpmath.mpf(x)), N))
                     for x in d.detach().double().tolist())
    assert float(gn) == pytest.approx(want_n, rel=rtol, abs=rtol)


def test_sincg_no_nan_at_zero_and_n_one():
    d = torch.tensor([0.0, -0.0, 1e-300, 1e-5, math.pi / 2, -math.pi / 2], dtype=DT, requires_grad=True)
    for n0 in (1.0, 5.0, 0.5):
        n = torch.tensor(n0, dtype=DT, requires_grad=True)
        out = sincg(d, n)
        gd, gn = torch.autograd.grad(out.sum(), (d, n), create_graph=True)
        (gdd,) = torch.autograd.grad(gd.sum(), d)
        for t in (out, gd, gn, gdd):
            assert torch.isfinite(t).all(), (n0, t)


# ---------------------------------------------------------------------------------------
# documented special cases
# ---------------------------------------------------------------------------------------
def test_no_mosaic_in_config_gives_exactly_zero_spread_gradient():
    """Without -mosaic (or with -mosaic 0) there is one domain and no axis: d/d(mosaic_spread)
    is exactly 0 (finite), whatever spread is passed (docs/gradients.md)."""
    sim = Simulator(config_from_args("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -default_F 100 -distance 100 "
                                     "-detpixels 32 -pixel 0.4 -mosaic 0".split()), dtype=DT, compile=False)
    for value in (0.0, 0.5):
        x = torch.tensor(value, dtype=DT, requires_grad=True)
        img = sim(mosaic_spread=x)
        assert img.max() > 0
        (g,) = torch.autograd.grad(img.sum(), x, allow_unused=True)
        assert g is None or float(g) == 0.0


def test_c_parity_phi_zero_quirk_has_finite_gradient():
    """C parity at phi0 = 0 with several phi steps: the C reuses the previous rotation for the
    step at exactly 0, so the image jumps there (docs/simulator.md); the gradient stays finite
    (it is the derivative of the branch taken) but is not a derivative of the jump."""
    probe = get_probe("c_parity")
    grads = _leaf_grads(probe, {"phi0": 0.0})
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
    assert float(grads["phi0"]) != 0.0


def test_all_canonical_parameters_have_gradients_at_the_direct_beam():
    probe = get_probe("direct_beam")
    grads = _leaf_grads(probe, {})
    names = [n for n in PARAMETER_NAMES if n in probe.names]  # this beam has one source: no widths
    assert set(names) <= set(grads) and len(names) == len(PARAMETER_NAMES) - 3
    zero = CASES["direct_beam"].zero  # the names its model does not use (anisotropic spreads, off-diagonal sizes)
    assert all(float(grads[n]) != 0.0 for n in names if n not in zero)
    assert all(float(grads[n]) == 0.0 for n in zero if n in names)
