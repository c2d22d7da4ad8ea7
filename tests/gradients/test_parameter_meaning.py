"""What the derivatives mean (docs/gradients.md), checked exactly.

* N_a, N_b, N_c: integers in the C, continuous here; an integer override reproduces the
  integer image, the image is smooth through integers, and at an exact Bragg position
  d ln I / d N_a = 2 / N_a (the peak height (Na Nb Nc)^2).
* mosaic_spread: the domain axes and angle fractions are drawn once per seed and scaled by
  the spread, so an override equals a fresh simulator with that spread, and L(spread) is
  smooth.
* scale identities (Euler): fluence dL/dfluence = L; sum F dL/dF + default_F dL/ddefault_F = 2L;
  scaling every length of the crystal and the wavelength together leaves h, k, l unchanged.
* structure-factor lookup at its discontinuities: nearest neighbour is piecewise constant
  in h, k, l (zero derivative, ties at h0 + 1/2 go down); tricubic is continuous with a
  derivative that jumps at integer h (autograd returns the right-sided one).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradient_probes import get_probe, one_thread_eager  # noqa: F401  (autouse fixture)
from nbtorch import Simulator, config_from_args
from nbtorch.tools.gradcheck_report import CASES, build_simulator, direct_beam_pixel
from nbtorch.physics.lattice import nearest_index
from nbtorch.physics.structure import nearest_structure_factor, tricubic_structure_factor

DT = torch.float64


def _t(v, grad=False):
    return torch.tensor(v, dtype=DT, requires_grad=grad)


# ---------------------------------------------------------------------------------------
# N_a, N_b, N_c
# ---------------------------------------------------------------------------------------
def test_integer_N_override_reproduces_the_integer_image():
    # -oversample fixed: its automatic value depends on the config's N (chosen once, at set-up)
    base = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -lambda 1 -default_F 100 -distance 100 -detpixels 24 "
            "-pixel 0.4 -oversample 2")
    five = Simulator(config_from_args((base + " -N 5").split()), dtype=DT, compile=False)
    other = Simulator(config_from_args((base + " -Na 3 -Nb 5 -Nc 7").split()), dtype=DT, compile=False)
    with torch.no_grad():
        a = five(N_a=_t(3.0), N_c=_t(7.0))
        b = other()
    assert b.max() > 0 and torch.allclose(a, b, rtol=1e-13, atol=0)


@pytest.mark.parametrize("case", ["mosaic", "round", "gauss"])
@pytest.mark.parametrize("value", [4.7, 5.0, 5.3])
def test_N_is_smooth_through_and_between_integers(case, value):
    probe = get_probe(case)
    at = {"N_a": value, "N_b": value + 0.2}
    for name in ("N_a", "N_b"):
        g = probe.autograd([name], at=at)[name]
        fd = probe.finite_difference(name, at=at)
        assert fd.consistent and abs(g - fd.value) <= 1e-9 + 1e-6 * abs(fd.value), (case, name, g, fd)


@pytest.mark.parametrize("case", ["direct_beam"])
@pytest.mark.parametrize("shape", ["-square_xtal", "-round_xtal", "-gauss_xtal"])
def test_dlnI_dN_at_an_exact_Bragg_position_is_2_over_N(case, shape):
    """The direct-beam pixel sits exactly on (000): F_latt = Na Nb Nc (x const), so
    d ln I / d N_i = 2 / N_i, also for non-integer N."""
    sim = build_simulator(dataclasses.replace(CASES[case], args=CASES[case].args + " " + shape))
    f, s = direct_beam_pixel(sim)
    for n in (5.0, 3.4):
        xs = {k: _t(v, True) for k, v in (("N_a", n), ("N_b", 5.0), ("N_c", 2.0))}
        img, _ = sim.render(roi=(f, f, s, s), **xs)
        grads = torch.autograd.grad(img.sum(), list(xs.values()))
        for (k, x), g in zip(xs.items(), grads):
            ratio = float(g) * float(x.detach()) / float(img.detach().sum())
            assert ratio == pytest.approx(2.0, rel=1e-12), (shape, k)


# ---------------------------------------------------------------------------------------
# mosaic spread
# ---------------------------------------------------------------------------------------
MOSAIC = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1 -default_F 100 -distance 100 -detpixels 256 "
          "-pixel 0.1 -mosaic_dom 6 -mosaic_seed 4242 -roi 100 123 100 123")


@pytest.mark.parametrize("c_parity", [False, True])
def test_mosaic_override_equals_fresh_simulator_with_that_spread(c_parity):
    extra = " -c_parity" if c_parity else ""
    a = Simulator(config_from_args((MOSAIC + " -mosaic 0.5" + extra).split()), dtype=DT, compile=False)
    b = Simulator(config_from_args((MOSAIC + " -mosaic 1.3" + extra).split()), dtype=DT, compile=False)
    assert np.array_equal(a.setup.mosaic_axes, b.setup.mosaic_axes)  # drawn once per seed ...
    assert np.array_equal(a.setup.mosaic_fractions, b.setup.mosaic_fractions)  # ... scaled by the spread
    assert len(a.setup.mosaic_fractions) == 6
    with torch.no_grad():
        ia, ib = a(mosaic_spread=_t(1.3)), b()
    assert ib.max() > 0
    assert torch.allclose(ia, ib, rtol=1e-12, atol=1e-12 * float(ib.max()))


@pytest.mark.parametrize("spread", [0.02, 0.2, 0.5, 1.0, 3.0])
def test_image_is_smooth_in_mosaic_spread(spread):
    probe = get_probe("mosaic")
    at = {"mosaic_spread": spread}
    g = probe.autograd(["mosaic_spread"], at=at)["mosaic_spread"]
    fd = probe.finite_difference("mosaic_spread", at=at)
    assert fd.consistent, fd
    assert abs(g) > 1e-7 and abs(g - fd.value) <= 1e-9 + 1e-6 * abs(fd.value)


# ---------------------------------------------------------------------------------------
# exact scale identities
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in CASES if "-water" not in CASES[c].args])
def test_fluence_and_structure_factor_homogeneity(case):
    """L is linear in fluence and quadratic in (F_grid, default_F) jointly (without water, whose
    background does not depend on F and, in C parity, grows with fluence squared)."""
    probe = get_probe(case)
    g = probe.autograd(["fluence", "default_F"])
    assert probe.base["fluence"] * g["fluence"] == pytest.approx(1.0, rel=1e-12)
    total = probe.base["default_F"] * g["default_F"]
    if probe.sim.F_grid is not None:
        total += float((probe.F_grid_gradient() * probe.sim.F_grid).sum())
    assert total == pytest.approx(2.0, rel=1e-10)


@pytest.mark.parametrize("case", [c for c in CASES if c != "gauss"])
def test_crystal_size_and_wavelength_scale_together(case):
    """h = a . (d - i) / lambda: scaling a, b, c and lambda by the same factor leaves every
    Miller index, hence the image, unchanged (not for gauss, whose spot size is in 1/A):
    a dL/da + b dL/db + c dL/dc + lambda dL/dlambda = 0."""
    probe = get_probe(case)
    names = ("cell_a", "cell_b", "cell_c", "wavelength")
    g = probe.autograd(names)
    terms = [probe.base[n] * g[n] for n in names]
    assert max(abs(t) for t in terms) > 1e-3
    assert abs(sum(terms)) <= 1e-10 * max(abs(t) for t in terms)


# ---------------------------------------------------------------------------------------
# structure-factor lookup at its discontinuities
# ---------------------------------------------------------------------------------------
def _grid():
    gen = torch.Generator().manual_seed(3)
    return 20.0 + 60.0 * torch.rand((9, 9, 9), generator=gen, dtype=DT), _t([-4.0, -4.0, -4.0]), _t([4.0, 4.0, 4.0])


def test_nearest_neighbour_is_piecewise_constant_ties_go_down():
    grid, lo, hi = _grid()
    for h in (1.5, 1.5 - 1e-12, 1.5 + 1e-12, 2.0, 2.49):
        hkl = _t([[h, 0.2, -1.1]], True)
        F = nearest_structure_factor(nearest_index(hkl), grid, lo, hi, _t(7.0))
        assert not F.requires_grad  # no dependence on the fractional indices at all: dF/dh = 0
        want_h0 = 1 if h <= 1.5 else 2
        assert float(F) == float(grid[want_h0 + 4, 0 + 4, -1 + 4])
    # the derivative with respect to the table is one-hot
    gt = grid.clone().requires_grad_(True)
    hkl = _t([[2.3, -0.4, 3.2]])
    (g,) = torch.autograd.grad(nearest_structure_factor(nearest_index(hkl), gt, lo, hi, _t(7.0)).sum(), gt)
    assert float(g.sum()) == 1.0 and float(g[2 + 4, 0 + 4, 3 + 4]) == 1.0


def test_tricubic_is_continuous_with_a_derivative_jump_at_integers():
    grid, lo, _ = _grid()

    def F(h):
        return tricubic_structure_factor(torch.stack([h, h * 0 + 0.3, h * 0 - 0.6], -1), grid, lo)

    for node in (-1.0, 0.0, 1.0):
        values, grads = [], []
        for dx in (-1e-9, 0.0, 1e-9):
            h = _t([node + dx], True)
            v = F(h)
            (g,) = torch.autograd.grad(v.sum(), h)
            values.append(float(v.detach()))
            grads.append(float(g))
        assert abs(values[0] - values[1]) < 1e-6 and abs(values[2] - values[1]) < 1e-6  # continuous
        assert grads[1] == pytest.approx(grads[2], rel=1e-6)  # exact node: the right-sided derivative
        assert abs(grads[0] - grads[1]) > 1e-3  # C0, not C1: the 4-point stencil changes at the node
    # smooth inside a cell: gradcheck on points away from the nodes
    h = _t([-0.7, 0.2, 0.45, 1.9], True)
    assert torch.autograd.gradcheck(lambda x: F(x), (h,), eps=1e-6, atol=1e-8, rtol=1e-6)
