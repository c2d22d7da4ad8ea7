"""The hot loop's analytic backward (SquareOrientationSum) against autograd and finite differences.

Eager only (gradcheck never meets a compiled graph); the compiled simulator that uses it is
compared with eager gradients in tests/gradients/test_compiled.py (slow) and the refinement
tests.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from nbtorch.physics.lattice import (
    lattice_factor_components, miller_indices, nearest_index, sincg_reduced_derivatives,
)
from nbtorch.physics.square_sum import square_orientation_sum
from nbtorch.physics.structure import nearest_structure_factor

DT = torch.float64


def _inputs(seed=0, P=48):
    """[sx, sy, sz, real_A, n_cells, default_F]: the differentiable inputs."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(3, 2, P, generator=g, dtype=DT) * 0.05  # (3, Q=2, P) scattering vectors (1/A)
    real = torch.eye(3, dtype=DT) * 30 + torch.randn(3, 2, 3, 3, generator=g, dtype=DT)  # (Φ=3, M=2, 3, 3)
    n = torch.tensor([5.0, 3.0, 4.5], dtype=DT)
    return [s[0].clone(), s[1].clone(), s[2].clone(), real, n, torch.tensor(7.0, dtype=DT)]


def _ours(xs, table=None):
    grid, lo, hi = table if table else (None, None, None)
    sx, sy, sz, real, n, dflt = xs
    (sums,) = square_orientation_sum(sx, sy, sz, real, n, grid, lo, hi, dflt)
    return sums


def _plain(sx, sy, sz, real, n, dflt, table=None):
    """The same sum through autograd (the eager kernel's formulation)."""
    hkl = miller_indices((sx, sy, sz), real)
    h0 = tuple(nearest_index(x) for x in hkl)
    latt = lattice_factor_components(hkl, h0, n, "square")
    f2 = dflt**2 if table is None else nearest_structure_factor(h0, *table, dflt) ** 2
    return (f2 * latt * latt).reshape((-1,) + tuple(sx.shape)).sum(0)


def _table(span=4):
    """A 5^3 table over -2..2 (the inputs' indices reach beyond it: some lookups take default_F)."""
    g = torch.Generator().manual_seed(3)
    grid = torch.rand(span + 1, span + 1, span + 1, generator=g, dtype=DT) * 100 + 1
    lo = torch.full((3,), -span / 2, dtype=DT)
    return grid, lo, lo + span


NAMES = ("sx", "sy", "sz", "real_A", "n_cells", "default_F")


@pytest.mark.parametrize("with_table", [False, True])
def test_analytic_backward_equals_autograd(with_table):
    args = [x.requires_grad_(True) for x in _inputs()]
    table = _table() if with_table else None
    ours = _ours(args, table)
    ref = _plain(*args, table=table)
    assert float(ref.detach().abs().max()) > 1.0  # a non-zero image: the test can fail
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=0)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    g_ours = torch.autograd.grad((ours * w).sum(), args)
    g_ref = torch.autograd.grad((ref * w).sum(), args)
    for name, a, b in zip(NAMES, g_ours, g_ref):
        assert float(b.abs().max()) > 0, name  # with a table too: some lookups fall outside it
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("wanted", [(0, 1, 2), (3,), (4,), (5,), (2, 4)])
def test_backward_computes_only_the_gradients_asked_for(wanted):
    """Detector-only, cell-only or N-only refinement skips the other reductions; values unchanged."""
    base = _inputs(seed=5)
    w = torch.randn(2, 48, generator=torch.Generator().manual_seed(6), dtype=DT)
    full = [x.clone().requires_grad_(True) for x in base]
    g_full = torch.autograd.grad((_ours(full) * w).sum(), full)
    part = [x.clone().requires_grad_(i in wanted) for i, x in enumerate(base)]
    g_part = torch.autograd.grad((_ours(part) * w).sum(), [part[i] for i in wanted])
    for i, g in zip(wanted, g_part):
        assert float(g.abs().max()) > 0
        torch.testing.assert_close(g, g_full[i], rtol=1e-12, atol=0)


def test_analytic_backward_matches_central_differences():
    base = _inputs(seed=2, P=16)
    w = torch.randn(2, 16, generator=torch.Generator().manual_seed(4), dtype=DT)

    def loss(xs):
        return float((_ours(xs) * w).sum())

    args = [x.clone().requires_grad_(True) for x in base]
    grads = torch.autograd.grad((_ours(args) * w).sum(), args)
    checked = 0
    probes = ((0, (0, 3)), (2, (1, 7)), (3, (1, 0, 2, 1)), (3, (0, 1, 0, 0)), (4, (0,)), (4, (2,)), (5, ()))
    for which, idx in probes:
        h = 1e-6 * max(1.0, abs(float(base[which][idx])))
        up = [x.clone() for x in base]
        dn = [x.clone() for x in base]
        up[which][idx] += h
        dn[which][idx] -= h
        fd = (loss(up) - loss(dn)) / (2 * h)
        an = float(grads[which][idx])
        assert an == pytest.approx(fd, rel=1e-5, abs=1e-6 * max(1.0, abs(fd))), (which, idx, an, fd)
        checked += abs(fd) > 1e-3
    assert checked >= 5  # the derivatives probed are not all zero


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-13), (torch.float32, 5e-6)])
@pytest.mark.parametrize("n", [1.0, 5.0, 3.7, 20.0])
def test_sincg_derivatives_against_mpmath(dtype, rtol, n):
    dh = [0.0, 1e-7, -1e-5, 1e-3, 0.1 / n, 0.49 / n, 0.51 / n, -0.3, 0.25, 0.5]
    f, fd, fn = sincg_reduced_derivatives(torch.tensor(dh, dtype=dtype), torch.tensor(n, dtype=dtype))
    with mpmath.workdps(40):
        for i, x in enumerate(dh):
            X, N = mpmath.mpf(x), mpmath.mpf(n)
            if x == 0.0:
                want = (N, 0, 1)
            else:
                s = mpmath.sin(mpmath.pi * X)
                v = mpmath.sin(mpmath.pi * N * X) / s
                want = (v, mpmath.pi * (N * mpmath.cos(mpmath.pi * N * X) - v * mpmath.cos(mpmath.pi * X)) / s,
                        mpmath.pi * X * mpmath.cos(mpmath.pi * N * X) / s)
            # scales: |f| <= n, |df/ddh| <~ n^3, |df/dn| <~ 1 (relative to those)
            for got, ref, scale in zip((f[i], fd[i], fn[i]), want, (n, n**3 * math.pi, 1.0)):
                assert abs(float(got) - float(ref)) <= rtol * scale, (x, float(got), float(ref))


@pytest.mark.parametrize("with_table", [False, True])
def test_forward_mode_matches_autograd_batched(with_table):
    """The analytic jvp, batched by torch.func.jacfwd (the esds' Jacobian), equals autograd's forward mode of the
    plain sum, for every input and for a table whose missing entries follow default_F (a tangent of the table)."""
    xs = _inputs(4)
    table = _table() if with_table else None

    def flat(v):
        return torch.cat([t.reshape(-1) for t in v])

    sizes = [t.numel() for t in xs]

    def split(v):
        parts = torch.split(v, sizes)
        return [p.reshape(t.shape) for p, t in zip(parts, xs)]

    def grid_of(dflt):  # entries 0 and 5 of the flat table are missing: they follow default_F
        if table is None:
            return None
        present = torch.ones_like(table[0], dtype=torch.bool).reshape(-1)
        present[[0, 5]] = False
        return torch.where(present.reshape(table[0].shape), table[0], dflt)

    def ours(v):
        a = split(v)
        grid = grid_of(a[5])
        return _ours(a, None if grid is None else (grid, table[1], table[2]))

    def plain(v):
        a = split(v)
        grid = grid_of(a[5])
        return _plain(*a, table=None if grid is None else (grid, table[1], table[2]))

    x = flat(xs)
    J = torch.func.jacfwd(ours)(x)
    J_ref = torch.func.jacfwd(plain)(x)
    assert torch.allclose(J, J_ref, rtol=1e-10, atol=1e-10 * float(J_ref.abs().max()))
