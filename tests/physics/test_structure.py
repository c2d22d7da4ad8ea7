"""Structure-factor lookup: nearest neighbour, tricubic interpolation, the C's stencil bounds."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from nbtorch.physics.lattice import nearest_index
from nbtorch.physics.structure import (
    in_grid,
    interpolation_safe,
    nearest_structure_factor,
    structure_factor,
    tricubic_structure_factor,
)

DT = torch.float64
HMIN = torch.tensor([-5.0, -4.0, -3.0], dtype=DT)
SHAPE = (11, 9, 8)  # h -5..5, k -4..4, l -3..4
HMAX = HMIN + torch.tensor(SHAPE, dtype=DT) - 1


def _random_grid(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(SHAPE, generator=g, dtype=DT) * 100.0 + 1.0


def _node_values(grid: torch.Tensor, hkl0: torch.Tensor) -> torch.Tensor:
    idx = (hkl0 - HMIN).long()
    return grid[idx[..., 0], idx[..., 1], idx[..., 2]]


def _cubic_poly(h, k, l):
    """Degree <= 3 in each index separately (tensor-product cubic), incl. mixed terms."""
    return (
        2.0 + 0.5 * h - 0.3 * k + 0.7 * l
        + 0.11 * h**3 - 0.07 * k**3 + 0.05 * l**3
        + 0.2 * h * k - 0.1 * k * l + 0.03 * h**2 * l
        + 0.004 * h**3 * k**2 * l**3
    )


def _grid_from(fn) -> torch.Tensor:
    h = torch.arange(SHAPE[0], dtype=DT) + HMIN[0]
    k = torch.arange(SHAPE[1], dtype=DT) + HMIN[1]
    l = torch.arange(SHAPE[2], dtype=DT) + HMIN[2]
    H, K, L = torch.meshgrid(h, k, l, indexing="ij")
    return fn(H, K, L)


def test_nearest_inside_and_outside():
    grid = _random_grid(1)
    default = torch.tensor(-7.5, dtype=DT)
    inside = torch.tensor([[0.2, 0.4, -0.3], [-5.4, -4.0, 4.49], [5.49, 4.3, -3.49]], dtype=DT)
    h0 = nearest_index(inside)
    got = nearest_structure_factor(h0, grid, HMIN, HMAX, default)
    assert torch.equal(got, _node_values(grid, h0))
    # -3.5 rounds to -4 (ceil(h - 0.5)): outside in l, so default
    outside = torch.tensor(
        [[5.51, 0.0, 0.0], [-5.51, 0.0, 0.0], [0.0, 4.6, 0.0], [0.0, 0.0, -3.51], [0.0, 0.0, 4.51], [40.0, -40.0, 9.0]],
        dtype=DT,
    )
    h0o = nearest_index(outside)
    assert not in_grid(h0o, HMIN, HMAX).any()
    assert torch.equal(nearest_structure_factor(h0o, grid, HMIN, HMAX, default), default.expand(6))
    # the public dispatcher gives the same
    assert torch.equal(structure_factor(outside, h0o, grid, HMIN, HMAX, default, False), default.expand(6))
    assert torch.equal(structure_factor(inside, h0, grid, HMIN, HMAX, default, False), got)
    # and no table at all means default_F everywhere
    none = structure_factor(inside, h0, None, None, None, default, False)
    assert torch.equal(none, default.expand(3))


def test_nearest_is_piecewise_constant_and_one_hot_in_grid():
    grid = _random_grid(2).requires_grad_(True)
    hkl = torch.tensor([[1.3, -2.2, 0.45]], dtype=DT, requires_grad=True)
    f = structure_factor(hkl, nearest_index(hkl.detach()), grid, HMIN, HMAX, torch.tensor(0.0, dtype=DT), False)
    g_grid, = torch.autograd.grad(f.sum(), grid)
    assert g_grid.sum() == 1.0 and (g_grid != 0).sum() == 1
    assert g_grid[1 + 5, -2 + 4, 0 + 3] == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_tricubic_exact_for_cubic_polynomial(seed):
    grid = _grid_from(_cubic_poly)
    rng = np.random.default_rng(seed)
    # points whose stencil is inside: h in [-3, 3], k in [-2, 2], l in [-1, 2]
    pts = np.stack([rng.uniform(-3, 3, 200), rng.uniform(-2, 2, 200), rng.uniform(-1, 2, 200)], -1)
    hkl = torch.tensor(pts, dtype=DT)
    assert interpolation_safe(hkl, HMIN, HMAX).all()
    got = tricubic_structure_factor(hkl, grid, HMIN)
    want = _cubic_poly(hkl[:, 0], hkl[:, 1], hkl[:, 2])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-11)
    # a quartic term is not reproduced (so the test can tell)
    quartic = _grid_from(lambda h, k, l: h**4)
    err = tricubic_structure_factor(hkl, quartic, HMIN) - hkl[:, 0] ** 4
    assert err.abs().max() > 1e-2


def test_tricubic_equals_grid_values_at_nodes():
    grid = _random_grid(3)
    nodes = torch.tensor(
        list(itertools.product(range(-3, 4), range(-2, 3), range(-1, 3))), dtype=DT
    )
    got = tricubic_structure_factor(nodes, grid, HMIN)
    assert torch.allclose(got, _node_values(grid, nodes), rtol=1e-13, atol=0)
    # and is continuous across a node
    for axis in range(3):
        e = torch.zeros(3, dtype=DT)
        e[axis] = 1e-9
        lo = tricubic_structure_factor(nodes - e, grid, HMIN)
        hi = tricubic_structure_factor(nodes + e, grid, HMIN)
        assert torch.allclose(lo, hi, rtol=0, atol=1e-6)


def _c_safe(h: float, k: float, l: float, hmin, hmax) -> bool:
    """nanoBragg.c: if (((h-h_min+3)>h_range) || (h-2<h_min) || ...) -> not safe; h_range = h_max-h_min+1."""
    out = False
    for v, lo, hi in zip((h, k, l), hmin, hmax):
        rng = hi - lo + 1
        out = out or ((v - lo + 3) > rng) or (v - 2 < lo)
    return not out


def test_interpolation_safe_matches_c_bounds():
    hmin = HMIN.tolist()
    hmax = HMAX.tolist()
    vals = np.round(np.arange(-6.0, 6.01, 0.25), 10).tolist() + [-3.0000001, 3.0000001, 2.9999999, -2.9999999]
    pts = [(v, 0.0, 0.5) for v in vals] + [(0.0, v, 0.5) for v in vals] + [(0.0, 0.0, v) for v in vals]
    got = interpolation_safe(torch.tensor(pts, dtype=DT), HMIN, HMAX).tolist()
    want = [_c_safe(*p, hmin, hmax) for p in pts]
    assert got == want
    # spot checks: h in [-3, 3] is safe for h_min -5, h_max 5, both ends included
    assert _c_safe(-3.0, 0, 0.5, hmin, hmax) and _c_safe(3.0, 0, 0.5, hmin, hmax)
    assert not _c_safe(3.01, 0, 0.5, hmin, hmax) and not _c_safe(-3.01, 0, 0.5, hmin, hmax)


def test_structure_factor_interpolate_falls_back_to_default():
    grid = _grid_from(_cubic_poly)
    default = torch.tensor(123.0, dtype=DT)
    hkl = torch.tensor([[0.3, 0.2, 0.1], [4.2, 0.0, 0.0], [0.0, -2.5, 0.0]], dtype=DT)
    f = structure_factor(hkl, nearest_index(hkl), grid, HMIN, HMAX, default, True)
    assert f[0].item() == pytest.approx(_cubic_poly(0.3, 0.2, 0.1), rel=1e-12)
    assert f[1].item() == 123.0 and f[2].item() == 123.0


def test_gradcheck_tricubic_wrt_grid_and_hkl():
    grid = _random_grid(4).requires_grad_(True)
    hkl = torch.tensor([[0.3, -1.7, 0.45], [-2.2, 1.1, 1.9], [2.6, 0.5, -0.6]], dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, h: tricubic_structure_factor(h, g, HMIN), (grid, hkl), fast_mode=True)
    assert torch.autograd.gradcheck(lambda h: tricubic_structure_factor(h, grid.detach(), HMIN), (hkl,))
    default = torch.tensor(5.0, dtype=DT)
    assert torch.autograd.gradcheck(
        lambda g, h: structure_factor(h, nearest_index(h.detach()), g, HMIN, HMAX, default, True), (grid, hkl),
        fast_mode=True,
    )
    # the h-derivative of an interpolated linear ramp is its slope
    ramp = _grid_from(lambda h, k, l: 3.0 * h - 2.0 * k + 0.5 * l).requires_grad_(False)
    x = torch.tensor([[0.37, -0.81, 1.2]], dtype=DT, requires_grad=True)
    g, = torch.autograd.grad(tricubic_structure_factor(x, ramp, HMIN).sum(), x)
    assert torch.allclose(g, torch.tensor([[3.0, -2.0, 0.5]], dtype=DT), atol=1e-12)
    assert not math.isnan(g.sum().item())
