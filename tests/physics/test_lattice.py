"""Lattice transforms: sincg, sinc3, shape peak values, nearest index, gradients."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

from nbtorch.physics.lattice import lattice_factor, nearest_index, sinc3_from_sq, sincg

DT = torch.float64
SPHERE_CUBE = 0.723601254558268


def _t(x, requires_grad=False):
    return torch.tensor(x, dtype=DT, requires_grad=requires_grad)


@pytest.mark.parametrize("n", [1.0, 2.0, 5.0, 17.0, 3.7])
def test_sincg_peak_is_n(n):
    out = sincg(_t([0.0, -0.0]), _t(n))
    assert torch.equal(out, _t([n, n]))
    # and continuous through the series/exact switch-over
    tiny = _t([1e-9, 5e-5, 9.9e-5, 1.01e-4, 2e-4])
    exact = torch.sin(n * tiny) / torch.sin(tiny)
    assert torch.allclose(sincg(tiny, _t(n)), exact, rtol=1e-12, atol=0)


@pytest.mark.parametrize("n", [1.0, 2.0, 5.0, 10.0, 2.5])
def test_sincg_away_from_zero(n):
    delta = torch.linspace(-math.pi / 2, math.pi / 2, 401, dtype=DT)
    delta = delta[delta.abs() > 1e-3]
    ref = np.sin(n * delta.numpy()) / np.sin(delta.numpy())
    np.testing.assert_allclose(sincg(delta, _t(n)).numpy(), ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_square_matches_direct_c_formula(n):
    """|sincg(pi (h - h0), N)|^2 == (sin(N pi h)/sin(pi h))^2: the C evaluates the unreduced h."""
    rng = np.random.default_rng(n)
    h = np.concatenate([rng.uniform(-5, 5, 200), rng.uniform(100, 1000, 100), [1234.37, -987.21, 0.3, -2.49]])
    h = h[np.abs(h - np.round(h)) > 1e-3]  # the C formula is 0/0 at integers
    ht = _t(h)
    ours = sincg(math.pi * (ht - nearest_index(ht)), _t(float(n))) ** 2
    c = (np.sin(n * np.pi * h) / np.sin(np.pi * h)) ** 2
    # the direct formula loses ~|pi h| eps absolute in its argument; compare relative to the peak
    np.testing.assert_allclose(ours.numpy(), c, rtol=1e-8, atol=1e-9 * n * n)
    # lattice_factor's square shape is the product of the three
    hkl = ht[:30, None].expand(30, 3).contiguous()
    lf = lattice_factor(hkl, nearest_index(hkl), _t([float(n)] * 3), "square")
    np.testing.assert_allclose((lf**2).numpy(), c[:30] ** 3, rtol=1e-7, atol=1e-9 * n**6)


def test_sincg_gradient_finite_at_zero_and_n_one():
    for n0 in (1.0, 5.0):
        for d0 in (0.0, 1e-8, 1e-5, 0.3):
            d = _t(d0, requires_grad=True)
            n = _t(n0, requires_grad=True)
            out = sincg(d, n)
            gd, gn = torch.autograd.grad(out, (d, n))
            assert torch.isfinite(gd) and torch.isfinite(gn), (n0, d0)
            # analytic derivatives of sin(n d)/sin(d)
            if d0 == 0.0:
                assert gd.item() == 0.0
                assert gn.item() == pytest.approx(1.0)
            else:
                with mpmath.workdps(50):
                    dd, nn = mpmath.mpf(d0), mpmath.mpf(n0)
                    s = mpmath.sin(dd)
                    want_d = float((nn * mpmath.cos(nn * dd) * s - mpmath.sin(nn * dd) * mpmath.cos(dd)) / s**2)
                    want_n = float(dd * mpmath.cos(nn * dd) / s)
                assert gd.item() == pytest.approx(want_d, rel=1e-6, abs=1e-9)
                assert gn.item() == pytest.approx(want_n, rel=1e-6, abs=1e-12)
    # through the lattice factor at an exact reciprocal lattice point, N = 1
    hkl = _t([[2.0, -1.0, 0.0]], requires_grad=True)
    ncell = _t([1.0, 1.0, 1.0], requires_grad=True)
    out = lattice_factor(hkl, nearest_index(hkl.detach()), ncell, "square").sum()
    g_hkl, g_n = torch.autograd.grad(out, (hkl, ncell))
    assert torch.isfinite(g_hkl).all() and torch.isfinite(g_n).all()


def test_gradcheck_sincg():
    delta = _t([-1.2, -0.3, 0.0, 3e-5, 0.05, 0.9, 1.5], requires_grad=True)
    n = _t([1.0, 2.0, 5.0, 4.5, 7.0, 3.0, 1.3], requires_grad=True)
    assert torch.autograd.gradcheck(sincg, (delta, n))
    assert torch.autograd.gradgradcheck(sincg, (delta, n))


def test_sinc3_from_sq():
    assert sinc3_from_sq(_t(0.0)).item() == 1.0
    x = _t([1e-4, 1e-3, 0.01, 0.2, 1.0, 2.5, 4.4934094579, 7.0, 20.0])  # 4.4934 = first zero (tan x = x)
    closed = 3.0 * (torch.sin(x) - x * torch.cos(x)) / x**3
    got = sinc3_from_sq(x * x)
    assert torch.allclose(got, closed, rtol=1e-6, atol=1e-9)
    assert abs(sinc3_from_sq(_t(4.4934094579**2)).item()) < 1e-9
    # continuity across the series switch-over (x^2 = 1e-6)
    lo, hi = sinc3_from_sq(_t(1e-6 * (1 - 1e-9))), sinc3_from_sq(_t(1e-6 * (1 + 1e-9)))
    assert abs(lo - hi) < 1e-9
    x2 = _t([0.0, 1e-7, 0.5, 3.0], requires_grad=True)
    assert torch.autograd.gradcheck(sinc3_from_sq, (x2,))


@pytest.mark.parametrize("shape, const", [("square", 1.0), ("round", SPHERE_CUBE), ("gauss", 1.0), ("tophat", 1.0)])
def test_shape_peak_values_at_integer_hkl(shape, const):
    n_cells = _t([3.0, 5.0, 8.0])
    hkl = _t([[0.0, 0.0, 0.0], [3.0, -2.0, 7.0], [-11.0, 4.0, 1.0]])
    recip = _t([[0.0144, 0.0, 0.0], [0.0015, 0.0129, 0.0], [-0.0013, -0.0030, 0.0111]])
    f = lattice_factor(hkl, nearest_index(hkl), n_cells, shape, recip)
    assert torch.allclose(f, torch.full((3,), 120.0 * const, dtype=DT), rtol=1e-14, atol=0)
    # off the peak the factor is smaller
    off = hkl + _t([0.45, -0.4, 0.42])
    f_off = lattice_factor(off, nearest_index(off), n_cells, shape, recip, fudge=1.0)
    assert (f_off.abs() < 120.0 * const).all()


def test_shapes_fall_off():
    n_cells = _t([5.0, 5.0, 5.0])
    recip = torch.eye(3, dtype=DT) * 0.02
    # round: zero where sqrt(hrad2) = 4.4934/pi along one axis
    dh = 4.4934094579 / math.pi / 5.0
    hkl = _t([[dh, 0.0, 0.0]])
    assert abs(lattice_factor(hkl, nearest_index(hkl), n_cells, "round").item()) < 1e-8
    # tophat: inside/outside the 0.3969 cut on rad*^2 (a* = 0.02 / A, N^3 = 125)
    r_edge = math.sqrt(0.3969) / 125.0 / 0.02
    inside, outside = _t([[r_edge * 0.99, 0, 0]]), _t([[r_edge * 1.01, 0, 0]])
    assert lattice_factor(inside, nearest_index(inside), n_cells, "tophat", recip).item() == 125.0
    assert lattice_factor(outside, nearest_index(outside), n_cells, "tophat", recip).item() == 0.0
    # gauss: exp(-rad2 / 0.63)
    x = 0.3
    hk = _t([[x, 0, 0]])
    want = 125.0 * math.exp(-((x * 0.02 * 125.0) ** 2) / 0.63)
    assert lattice_factor(hk, nearest_index(hk), n_cells, "gauss", recip).item() == pytest.approx(want, rel=1e-13)
    with pytest.raises(ValueError):
        lattice_factor(hk, nearest_index(hk), n_cells, "gauss", None)
    with pytest.raises(ValueError):
        lattice_factor(hk, nearest_index(hk), n_cells, "cubeoid", recip)


def test_nearest_index_ties_go_down():
    h = _t([0.5, 1.5, 2.5, -0.5, -1.5, 0.49, 0.51, -0.51, 3.0, -3.0, 1e6 + 0.5])
    want = _t([0.0, 1.0, 2.0, -1.0, -2.0, 0.0, 1.0, -1.0, 3.0, -3.0, 1e6])
    assert torch.equal(nearest_index(h), want)
    # differs from round-half-to-even exactly at these ties
    assert not torch.equal(torch.round(h), want)
    assert torch.equal(nearest_index(h), torch.ceil(h - 0.5))


def _sinc3_reference(x2: np.ndarray) -> np.ndarray:
    """sinc3 from its Taylor series (small x) and the closed form (large x), both accurate in float64."""
    x2 = np.asarray(x2, dtype=np.float64)
    series = 1 - x2 / 10 + x2**2 / 280 - x2**3 / 15120 + x2**4 / 1330560 - x2**5 / 172972800
    x = np.sqrt(np.maximum(x2, 1e-300))
    closed = 3.0 * (np.sin(x) - x * np.cos(x)) / x**3
    return np.where(x2 < 0.05, series, closed)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-9), (torch.float32, 2e-6)])
def test_sinc3_from_sq_accurate_near_zero(dtype, rtol):
    """No cancellation loss in 3 (sin x - x cos x) / x^3 just above the series switch-over.

    Near a spot centre of the round shape x^2 = pi^2 fudge hrad^2 is small; the
    closed form loses about eps / x^2 relative accuracy there.
    """
    x2 = np.concatenate([np.geomspace(1e-9, 1.0, 61), [1.0000001e-6, 2e-6, 1e-5, 3e-4, 5e-3]])
    got = sinc3_from_sq(torch.tensor(x2, dtype=dtype)).double().numpy()
    np.testing.assert_allclose(got, _sinc3_reference(x2), rtol=rtol, atol=0)


def _recorded(x):
    """``x`` as a tensor that records derivatives: the library then takes its out-of-place Horner chain."""
    return x.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polynomial_in_place_is_the_same_bits(dtype):
    """Without derivatives the sincg polynomials update their accumulator in place: the same values bit for bit
    as the out-of-place Horner chain taken when derivatives are recorded (eager renders and compiled kernels
    agree as before)."""
    from nbtorch.physics import lattice

    x = torch.linspace(-0.5, 0.5, 10_001, dtype=dtype)
    c = lattice._SINC_PI[dtype]
    n = torch.tensor(7.3, dtype=dtype)
    with torch.no_grad():
        assert lattice._plain_values(x * x)
        in_place = lattice._poly_x2(x * x, c), lattice.sincg_reduced(x, n)
    assert not lattice._plain_values(_recorded(x))
    assert torch.equal(in_place[0], lattice._poly_x2(_recorded(x * x), c).detach())
    assert torch.equal(in_place[1], lattice.sincg_reduced(_recorded(x), n).detach())


def test_polynomial_keeps_every_kind_of_derivative():
    """Reverse mode, forward mode and torch.func see the out-of-place chain (an in-place update would break
    their records): each gives the derivative of the closed form sin(pi n x)/sin(pi x)."""
    from torch.autograd import forward_ad

    from nbtorch.physics import lattice

    x0 = torch.tensor([0.013, -0.21, 0.37], dtype=DT)
    n = torch.tensor(5.5, dtype=DT)

    def closed(x):
        return torch.sin(math.pi * n * x) / torch.sin(math.pi * x)

    expected = torch.func.vmap(torch.func.grad(closed))(x0)
    x = x0.clone().requires_grad_(True)
    assert not lattice._plain_values(x * x)
    (g,) = torch.autograd.grad(lattice.sincg_reduced(x, n).sum(), x)
    assert torch.allclose(g, expected, rtol=1e-12)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x0, torch.ones_like(x0))
        assert not lattice._plain_values(dual)
        tangent = forward_ad.unpack_dual(lattice.sincg_reduced(dual, n)).tangent
    assert torch.allclose(tangent, expected, rtol=1e-12)
    jac = torch.func.jacfwd(lambda x: lattice.sincg_reduced(x, n))(x0)
    assert torch.allclose(torch.diagonal(jac), expected, rtol=1e-12)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 2.3e-16), (torch.float32, 1e-7)])
def test_sinc_pi_polynomials_are_within_rounding(dtype, rtol):
    """The fitted polynomial of sin(pi x)/(pi x) and its derivative polynomial S1 ((d/dx)/(2x)) against mpmath on
    |x| <= 1/2, evaluated in their own dtype: within one rounding (a wrong or truncated coefficient fails)."""
    from nbtorch.physics import lattice

    t = torch.linspace(0.0, 0.5, 1001, dtype=dtype)
    x = t.double().numpy()  # the values the polynomial sees
    with mpmath.workdps(40):
        ref = np.array([1.0 if v == 0 else float(mpmath.sin(mpmath.pi * v) / (mpmath.pi * v)) for v in x])
        ref_s1 = np.array([float(-mpmath.pi**2 / 6) if v == 0 else float(
            (mpmath.pi * v * mpmath.cos(mpmath.pi * v) - mpmath.sin(mpmath.pi * v)) / (2 * mpmath.pi * mpmath.mpf(v) ** 3))
            for v in x])
    got = lattice.sinc_pi(t).double().numpy()
    got_s1 = lattice._poly_x2(t * t, lattice._SINC_PI_D1[dtype]).double().numpy()
    assert np.abs(got / ref - 1).max() <= rtol
    assert np.abs(got_s1 / ref_s1 - 1).max() <= rtol
    assert lattice._SINC_PI[dtype][0] == 1.0  # exactly n at the Bragg condition
