"""Lattice (crystal shape) transforms F_latt.

Shapes (nanoBragg ``-square_xtal`` default, ``-round_xtal``, ``-gauss_xtal``,
``-tophat_spots``; and ``-gauss_aniso_xtal``, not in the C):

* ``square``: ``prod_i sincg(pi h_i, N_i)``, sincg(x, N) = sin(N x)/sin(x), N at x = 0;
* ``round``: ``Na Nb Nc 0.723601254558268 sinc3(pi sqrt(fudge hrad^2))`` with
  ``hrad^2 = sum (h_i - h0_i)^2 N_i^2``;
* ``gauss``: ``Na Nb Nc exp(-rad*^2 fudge / 0.63)``;
* ``tophat``: ``Na Nb Nc [rad*^2 fudge < 0.3969]``,
  with ``rad*^2 = |dh a* + dk b* + dl c*|^2 (Na Nb Nc)^2`` (a* in 1/A, as the C);
* ``gauss_aniso``: ``det(N) exp(-dh^T N^T N dh fudge / 0.63)`` with the symmetric
  size matrix ``N = [[Na, Nd, Nf], [Nd, Nb, Ne], [Nf, Ne, Nc]]`` (unit cells) and
  ``dh = h - h0`` the fractional Miller offsets (cctbx diffBragg's Nabc/Ndef
  crystal): :func:`anisotropic_gauss`.

The ``gauss_aniso`` prefactor ``det N`` (``Na Nb Nc`` for a diagonal N) makes the
integrated spot behave as a crystal's must.  ``N dh`` maps the offset from the
reciprocal lattice point into the crystal's own "cells across" frame, so the
spot is a Gaussian ellipsoid whose widths along the principal axes of N are
``1/n_k`` (n_k the eigenvalues of N: the crystal's extent in unit cells along
those axes).  Its square integrates over one reciprocal cell (in Miller units) to::

    det(N)^2 (pi 0.63 / (2 fudge))^(3/2) / |det N| = |det N| (0.315 pi / fudge)^(3/2)

i.e. proportional to ``det N``, the number of unit cells in the crystal (the
volume of the parallelepiped N spans), as the square crystal's
``sum sincg^2 = Na Nb Nc``; the factor ``(0.315 pi)^(3/2) = 0.984`` at fudge 1.
The peak ``det(N)^2`` grows as the volume squared, as for any coherent crystal.
A prefactor of ``Na Nb Nc`` instead would let the off-diagonal terms change the
integrated intensity of every spot (a shear of the crystal would scale the
whole pattern), which the overall scale would then have to absorb.  ``det N`` is
positive for the physical (positive definite) N; the image uses ``F_latt^2``, so
a sign would not matter, and the value is smooth in all six sizes everywhere.

The image uses F_latt^2, so only |F_latt| matters.  ``sincg`` is evaluated
on the argument reduced to the nearest lattice point (``dh = h - h0``):
``|sin(N pi dh)/sin(pi dh)|`` equals the C's value for integer N, is accurate
for large h, and is smooth in both h and N: for non-integer N it is the
natural continuation used for gradients (see ``docs/gradients.md``).  It is
computed with one polynomial (:func:`sinc_pi`) after a range reduction, not
with library sines (see :func:`sincg_reduced`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor
from torch.autograd import forward_ad

_SPHERE_CUBE = 0.723601254558268
SHAPES = ("square", "round", "gauss", "tophat", "gauss_aniso")
#: the shape whose size is the symmetric matrix N (six values Na Nb Nc Nd Ne Nf); the others use Na Nb Nc
ANISOTROPIC_SHAPE = "gauss_aniso"


def miller_indices(scatter: tuple[Tensor, Tensor, Tensor], real_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fractional ``h_i = a_i . S``: components (...) of S (1/A) and (Φ, M, 3, 3) rows a, b, c (A) -> 3 x (Φ, M, ...).

    Broadcast multiply-adds on separate components (no matmul, no trailing
    axis of 3), so a compiler fuses them into the loop that uses them.
    """
    sx, sy, sz = scatter
    extra = (1,) * sx.dim()
    out = []
    for i in range(3):
        a = [real_A[..., i, j].reshape(real_A.shape[:2] + extra) for j in range(3)]
        out.append(sx * a[0] + sy * a[1] + sz * a[2])
    return tuple(out)


def nearest_index(h: Tensor) -> Tensor:
    """Nearest integer as the C rounds it: ``ceil(h - 0.5)`` (ties go down)."""
    return torch.ceil(h - 0.5)


# ``sin(pi x)/(pi x)`` for |x| <= 1/2 as a polynomial in ``x^2`` (the constant term exactly 1): a
# relative-error least-squares fit on 80 Chebyshev nodes of x^2 in [0, 1/4] (mpmath, 50 digits), i.e.
# close to minimax.  In the dtype it is evaluated in, both it and its derivative polynomial (``S1`` below)
# are within rounding of the function: <= 2.3e-16 relative in float64 (9 terms; a Taylor series needs 12)
# and <= 1e-7 in float32 (6 terms; Taylor 7): tests/physics/test_lattice.py checks both against mpmath.
_SINC_PI = {
    torch.float64: (
        1.0, -1.6449340668482264, 0.8117424252833398, -0.19075182412149266, 0.026147847805338208,
        -0.00234608089281165, 0.0001484278262022936, -6.972057469521811e-06, 2.449836938250255e-07,
    ),
    torch.float32: (
        1.0, -1.6449340627266926, 0.8117422047340893, -0.19074792262259024, 0.02611737314851152,
        -0.0022368862336569206,
    ),
}


def sinc_pi(x: Tensor) -> Tensor:
    """``sin(pi x) / (pi x)`` for ``|x| <= 1/2`` (1 at 0): an even polynomial, smooth, no cancellation."""
    return _poly_x2(x * x, _SINC_PI.get(x.dtype, _SINC_PI[torch.float64]))


def sincg_reduced(dh: Tensor, n: Tensor) -> Tensor:
    """``sin(pi n dh) / sin(pi dh)`` for ``|dh| <= 1/2`` (``dh = h - h0``), ``n`` at ``dh = 0``.

    Both sines come from one range reduction and the polynomial :func:`sinc_pi`
    (no library ``sin``: this is the innermost operation of the simulator and
    vectorises to a few fused multiply-adds).  With ``y = n dh``, ``m`` the
    nearest integer to ``y`` and ``r = y - m`` (``|r| <= 1/2``)::

        sin(pi y) = (-1)^m sin(pi r) = (-1)^m pi r sinc_pi(r)
        sincg     = sinc_pi(r) / sinc_pi(dh) * ((-1)^m r / dh)     (m != 0)
                  = sinc_pi(y) / sinc_pi(dh) * n                   (m == 0, then r = y)

    The second form has no ``0/0`` at the Bragg condition and its derivatives
    need no cancelling difference, so value and gradients are accurate to
    rounding in float32 and float64 for any ``dh``, and smooth in ``n``
    (non-integer ``n`` is the natural continuation used for gradients).
    """
    r, centre, sign = _range_reduced(dh, n)
    one = torch.ones_like(dh)
    return sinc_pi(r) / sinc_pi(dh) * torch.where(centre, n * one, sign * r / torch.where(centre, one, dh))


def _range_reduced(dh: Tensor, n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(r, m == 0, (-1)^m)`` with ``y = n dh``, ``m = round(y)``, ``r = y - m`` (see :func:`sincg_reduced`)."""
    y = n * dh
    m = torch.round(y)
    return y - m, m == 0, 1.0 - 2.0 * (m - 2.0 * torch.floor(0.5 * m))


def _poly_x2(x2: Tensor, c: tuple[float, ...]) -> Tensor:
    """``sum_k c[k] x2^k`` by Horner's rule; in place on its own accumulator where nothing records derivatives
    (:func:`_plain_values`): the same operations in the same order, so the same bits, without a new
    evaluations-sized temporary per operation (eager renders of large tiles: the polynomial ~3x faster)."""
    acc = x2 * c[-1] + c[-2]
    if _plain_values(x2):
        for ck in reversed(c[:-2]):
            acc.mul_(x2).add_(ck)
        return acc
    for ck in reversed(c[:-2]):
        acc = acc * x2 + ck
    return acc


def _plain_values(x: Tensor) -> bool:
    """Whether ``x`` is a plain tensor whose results may be updated in place: nothing is being traced or
    compiled, it records no reverse-mode graph, carries no forward-mode tangent and is no ``torch.func``
    wrapper (vmap, jacfwd)."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False
    return forward_ad.unpack_dual(x).tangent is None


# S1 with d/dx sinc_pi(x) = 2 x S1(x); then cos(pi x) = sinc_pi(x) + 2 x^2 S1(x)
_SINC_PI_D1 = {dt: tuple(k * c[k] for k in range(1, len(c))) for dt, c in _SINC_PI.items()}


def sincg_reduced_derivatives(dh: Tensor, n: Tensor, with_dn: bool = True) -> tuple[Tensor, ...]:
    """``(f, df/ddh[, df/dn])`` of ``f = sincg_reduced(dh, n)``, analytically (no autograd graph).

    With ``C(x) = cos(pi x) = sinc_pi(x) + 2 x^2 S1(x)``, ``sinc_pi'(x) = 2 x S1(x)``
    and the notation of :func:`sincg_reduced`::

        df/dn  = (-1)^m C(r) / sinc_pi(dh)
        df/ddh = (n (-1)^m C(r) - f C(dh)) / (dh sinc_pi(dh))                      (m != 0)
               = 2 n dh (n^2 S1(y) sinc_pi(dh) - sinc_pi(y) S1(dh)) / sinc_pi(dh)^2  (m == 0)

    The second form avoids the cancellation of the first near the Bragg
    condition.  Two polynomials per argument (``sinc_pi`` and ``S1``; the cosine
    is built from them) and two reciprocals: this runs once per evaluation in
    the backward of the hot loop.  ``with_dn=False`` leaves out ``df/dn``.
    """
    key = dh.dtype if dh.dtype in _SINC_PI else torch.float64
    s1 = _SINC_PI_D1[key]
    r, centre, sign = _range_reduced(dh, n)
    r2, d2 = r * r, dh * dh
    sr, sd = sinc_pi(r), _poly_x2(d2, _SINC_PI[key])
    qr, qd = _poly_x2(r2, s1), _poly_x2(d2, s1)
    inv_sd = 1.0 / sd
    inv_dh = 1.0 / torch.where(centre, torch.ones_like(dh), dh)
    f = sr * inv_sd * torch.where(centre, n * torch.ones_like(dh), sign * r * inv_dh)
    cr = sign * (sr + 2.0 * r2 * qr)
    outer = (n * cr - f * (sd + 2.0 * d2 * qd)) * (inv_dh * inv_sd)
    inner = (2.0 * n) * dh * (n * n * qr * sd - sr * qd) * (inv_sd * inv_sd)
    fd = torch.where(centre, inner, outer)
    return (f, fd, cr * inv_sd) if with_dn else (f, fd)


def sincg(delta: Tensor, n: Tensor) -> Tensor:
    """``sin(n delta) / sin(delta)`` with the limit ``n`` at ``delta = 0``, for ``|delta| <= pi/2``.

    ``delta = pi (h - h0)``; see :func:`sincg_reduced` (values and gradients
    accurate to rounding, including ``delta = 0`` and ``n = 1``).
    """
    return sincg_reduced(delta * (1.0 / math.pi), n)


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
        n_cells: (3,) Na, Nb, Nc (continuous values allowed); (6,) Na Nb Nc Nd Ne Nf for ``gauss_aniso``.
        shape: one of ``square, round, gauss, tophat, gauss_aniso``.
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
        return sincg_reduced(dh[0], n_cells[0]) * sincg_reduced(dh[1], n_cells[1]) * sincg_reduced(dh[2], n_cells[2])
    if shape == ANISOTROPIC_SHAPE:
        return anisotropic_gauss(tuple(dh), n_cells, fudge)
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


def size_vector(diagonal: Sequence[Tensor], off_diagonal: Sequence[Tensor], shape: str) -> Tensor:
    """The kernel's ``n_cells``: (3,) Na Nb Nc, or (6,) Na Nb Nc Nd Ne Nf for ``gauss_aniso`` (0-d tensors in)."""
    return torch.stack([*diagonal, *off_diagonal] if shape == ANISOTROPIC_SHAPE else [*diagonal])


def size_matrix_determinant(n_cells: Tensor) -> Tensor:
    """``det N`` of the symmetric size matrix ``[[Na, Nd, Nf], [Nd, Nb, Ne], [Nf, Ne, Nc]]`` from
    ``n_cells`` (..., 6) = Na Nb Nc Nd Ne Nf (unit cells; cells^3): the number of unit cells in the crystal."""
    na, nb, nc, nd, ne, nf = n_cells.unbind(-1)
    return na * (nb * nc - ne * ne) - nd * (nd * nc - ne * nf) + nf * (nd * ne - nb * nf)


def anisotropic_gauss(dh: tuple[Tensor, Tensor, Tensor], n_cells: Tensor, fudge: float | Tensor = 1.0) -> Tensor:
    """F_latt of the Gaussian crystal with the symmetric size matrix N: ``det(N) exp(-|N dh|^2 fudge / 0.63)``.

    ``dh``: the fractional Miller offsets ``h - h0, k - k0, l - l0`` (any equal shapes); ``n_cells`` (6,):
    Na Nb Nc on the diagonal of N and Nd (a-b), Ne (b-c), Nf (a-c) off it, in unit cells.  ``|N dh|^2 =
    dh^T N^T N dh`` (N symmetric: ``N^T N = N^2``).  Written on separate components (no matmul, no
    trailing axis of 3) so that a compiler fuses it into the hot loop; smooth in ``dh`` and all six sizes.
    With Nd = Ne = Nf = 0 it is ``Na Nb Nc exp(-sum_i (N_i dh_i)^2 fudge / 0.63)``, a product of one
    Gaussian per axis (the prefactor: module docstring).
    """
    na, nb, nc, nd, ne, nf = n_cells.unbind(-1)
    u0 = dh[0] * na + dh[1] * nd + dh[2] * nf
    u1 = dh[0] * nd + dh[1] * nb + dh[2] * ne
    u2 = dh[0] * nf + dh[1] * ne + dh[2] * nc
    q = u0 * u0 + u1 * u1 + u2 * u2
    return size_matrix_determinant(n_cells) * torch.exp(-q * (fudge / 0.63))
