"""Lattice (crystal shape) transforms F_latt.

Shapes (nanoBragg ``-square_xtal`` default, ``-round_xtal``, ``-gauss_xtal``,
``-tophat_spots``):

* ``square``: ``prod_i sincg(pi h_i, N_i)``, sincg(x, N) = sin(N x)/sin(x), N at x = 0;
* ``round``: ``Na Nb Nc 0.723601254558268 sinc3(pi sqrt(fudge hrad^2))`` with
  ``hrad^2 = sum (h_i - h0_i)^2 N_i^2``;
* ``gauss``: ``Na Nb Nc exp(-rad*^2 fudge / 0.63)``;
* ``tophat``: ``Na Nb Nc [rad*^2 fudge < 0.3969]``,
  with ``rad*^2 = |dh a* + dk b* + dl c*|^2 (Na Nb Nc)^2`` (a* in 1/A, as the C).

The image uses F_latt^2, so only |F_latt| matters.  ``sincg`` is evaluated
on the argument reduced to the nearest lattice point (``delta = pi (h - h0)``),
``|sin(N delta)/sin(delta)|`` equals the C's value for integer N, is accurate
for large h, and is smooth in both h and N: for non-integer N it is the
natural continuation used for gradients (see ``docs/gradients.md``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_SPHERE_CUBE = 0.723601254558268
SHAPES = ("square", "round", "gauss", "tophat")


def nearest_index(h: Tensor) -> Tensor:
    """Nearest integer as the C rounds it: ``ceil(h - 0.5)`` (ties go down)."""
    return torch.ceil(h - 0.5)


def sincg(delta: Tensor, n: Tensor) -> Tensor:
    """``sin(n delta) / sin(delta)`` with the limit ``n`` at ``delta = 0``.

    ``delta`` should be reduced to [-pi/2, pi/2] (``pi (h - h0)``).  Gradients are
    finite everywhere, including ``delta = 0`` and ``n = 1``, and accurate near the exact
    Bragg condition: autograd through the closed form cancels catastrophically for small
    ``n delta`` (relative error ~6 eps / ((n^2 - 1) delta^2): up to ~100 % in float32 at
    ``|delta| ~ 1e-4``), so for ``|n delta| < 0.2`` the Taylor series in ``delta^2`` is used
    (to ``delta^8``; error < 1e-13 relative).  Derivatives, relative: < 2e-5 in float32 and
    < 1e-10 in float64 for n >= 1; values equal the closed form's to rounding.
    """
    nd = n * delta
    small = nd.abs() < 0.2
    safe = torch.where(small, torch.ones_like(delta), delta)
    exact = torch.sin(n * safe) / torch.sin(safe)
    # sin(n d)/sin(d) = n (1 - c1 d^2 + c2 d^4 - c3 d^6 + c4 d^8 - ...); every c_k vanishes at n = 1
    n2 = n * n
    c1 = (n2 - 1.0) / 6.0
    c2 = ((3.0 * n2 - 10.0) * n2 + 7.0) / 360.0
    c3 = (((3.0 * n2 - 21.0) * n2 + 49.0) * n2 - 31.0) / 15120.0
    c4 = ((((10.0 * n2 - 120.0) * n2 + 588.0) * n2 - 1240.0) * n2 + 762.0) / 3628800.0
    d2 = delta * delta
    series = n * (1.0 - d2 * (c1 - d2 * (c2 - d2 * (c3 - d2 * c4))))
    return torch.where(small, series, exact)


def sinc3_from_sq(x2: Tensor) -> Tensor:
    """``sinc3(x) = 3 (sin x - x cos x) / x^3`` given ``x^2`` (>= 0); 1 at 0, smooth there.

    Below ``x^2 = 1`` the closed form cancels badly (relative error ~eps/x^2), so
    a Taylor series is used there (error < 1e-15 relative for x^2 < 1).
    """
    small = x2 < 1.0
    safe2 = torch.where(small, torch.ones_like(x2), x2)
    x = torch.sqrt(safe2)
    exact = 3.0 * (torch.sin(x) - x * torch.cos(x)) / (x * safe2)
    series = 1.0 - x2 * (1 / 10 - x2 * (1 / 280 - x2 * (1 / 15120 - x2 * (1 / 1330560 - x2 * (1 / 172972800 - x2 / 31135104000)))))
    return torch.where(small, series, exact)


def lattice_factor(
    hkl: Tensor,
    hkl0: Tensor,
    n_cells: Tensor,
    shape: str,
    recip: Tensor | None = None,
    fudge: float | Tensor = 1.0,
) -> Tensor:
    """F_latt for fractional indices.

    Arguments:
        hkl: (..., 3) fractional Miller indices.
        hkl0: (..., 3) nearest integers (``nearest_index(hkl)``).
        n_cells: (3,) Na, Nb, Nc (continuous values allowed).
        shape: one of ``square, round, gauss, tophat``.
        recip: (3, 3) reciprocal basis rows in 1/A (gauss and tophat only).
        fudge: the ``-fudge`` factor.

    Returns:
        (...) lattice factor (its square is the lattice intensity).
    """
    return lattice_factor_components(hkl.unbind(-1), hkl0.unbind(-1), n_cells, shape, recip, fudge)


def lattice_factor_components(
    hkl: tuple[Tensor, Tensor, Tensor],
    hkl0: tuple[Tensor, Tensor, Tensor],
    n_cells: Tensor,
    shape: str,
    recip: Tensor | None = None,
    fudge: float | Tensor = 1.0,
) -> Tensor:
    """:func:`lattice_factor` on separate (h, k, l) tensors (no trailing axis: vectorises well)."""
    dh = [x - x0 for x, x0 in zip(hkl, hkl0)]
    if shape == "square":
        return (
            sincg(math.pi * dh[0], n_cells[0])
            * sincg(math.pi * dh[1], n_cells[1])
            * sincg(math.pi * dh[2], n_cells[2])
        )
    nnn = n_cells[0] * n_cells[1] * n_cells[2]
    if shape == "round":
        hrad2 = sum(d * d * n * n for d, n in zip(dh, n_cells.unbind(-1)))
        return nnn * _SPHERE_CUBE * sinc3_from_sq((math.pi**2) * fudge * hrad2)
    if recip is None:
        raise ValueError(f"shape {shape!r} needs the reciprocal basis")
    # |dh a* + dk b* + dl c*|^2 with a* etc. the rows of recip (1/A)
    comps = [dh[0] * recip[0, j] + dh[1] * recip[1, j] + dh[2] * recip[2, j] for j in range(3)]
    rad2 = (comps[0] * comps[0] + comps[1] * comps[1] + comps[2] * comps[2]) * nnn * nnn
    if shape == "gauss":
        return nnn * torch.exp(-rad2 * fudge / 0.63)
    if shape == "tophat":
        return nnn * (rad2 * fudge < 0.3969).to(rad2.dtype)
    raise ValueError(f"unknown crystal shape {shape!r}; expected one of {SHAPES}")
