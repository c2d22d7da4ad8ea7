"""Orientation sum of a square (parallelepiped) crystal with an analytic backward.

The hot loop of the simulator, ``sums[x] = sum_e F_e^2 L_e^2`` over the
orientations ``e`` (phi steps x mosaic domains) of every scattering vector
``x``, with ``L = prod_i sincg(h_i - h0_i, N_i)`` and ``h_i = a_i(e) . S(x)``.
Autograd through the fused forward stores or recomputes a dozen tensors of size
orientations x pixels and costs ~13x the forward; here the backward recomputes
the Miller indices once and uses the closed-form derivatives of ``sincg``
(:func:`~nbtorch.physics.lattice.sincg_reduced_derivatives`)::

    G_i[e, x] = g[x] 2 F^2 L prod_{j != i} L_j  dL_i/ddh          (3 tensors, orientations x pixels)
    grad S_j[x]       = sum_{e,i} G_i[e, x] a_ij(e)             (one matrix product)
    grad a_ij(e)      = sum_x G_i[e, x] S_j[x]                  (one reduction over pixels)
    grad N_i          = sum_{e,x} g 2 F^2 L prod_{j != i} L_j dL_i/dN

``F`` (nearest-neighbour lookup, piecewise constant in h) is an input without
gradient here; callers use this only when the structure-factor table needs no
gradient and the crystal shape is ``square`` (see
:func:`~nbtorch.physics.kernel.orientation_sum`).  Shapes: ``s*`` (..., P),
``real_A`` (Φ, M, 3, 3) rows a, b, c (Angstrom), ``n_cells`` (3,).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nbtorch.physics.lattice import (
    lattice_factor_components, miller_indices, nearest_index, sincg_reduced_derivatives,
)
from nbtorch.physics.structure import nearest_structure_factor


def _f_squared(hkl0: list[Tensor], F_grid, hkl_min, hkl_max, default_F) -> Tensor | float:
    if F_grid is None:  # the caller multiplies by default_F^2 (and differentiates it)
        return 1.0
    f = nearest_structure_factor(tuple(hkl0), F_grid, hkl_min, hkl_max, default_F)
    return f * f


class SquareOrientationSum(torch.autograd.Function):
    """``sum over (Φ, M) of F^2 L^2`` for a square crystal; differentiable in S, real_A and N."""

    @staticmethod
    def forward(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F):  # type: ignore[override]
        hkl = list(miller_indices((sx, sy, sz), real_A))
        hkl0 = [nearest_index(h) for h in hkl]
        latt = lattice_factor_components(tuple(hkl), tuple(hkl0), n_cells, "square")
        term = _f_squared(hkl0, F_grid, hkl_min, hkl_max, default_F) * latt * latt
        return term.reshape((-1,) + tuple(sx.shape)).sum(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F = inputs
        ctx.save_for_backward(sx, sy, sz, real_A, n_cells)
        ctx.table = (F_grid, hkl_min, hkl_max, default_F)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        sx, sy, sz, real_A, n_cells = ctx.saved_tensors
        F_grid, hkl_min, hkl_max, default_F = ctx.table
        need_s = any(ctx.needs_input_grad[:3])
        need_a, need_n = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        hkl = list(miller_indices((sx, sy, sz), real_A))
        hkl0 = [nearest_index(h) for h in hkl]
        parts = [sincg_reduced_derivatives(hkl[i] - hkl0[i], n_cells[i], need_n) for i in range(3)]
        f = [p[0] for p in parts]
        others = (f[1] * f[2], f[0] * f[2], f[0] * f[1])
        # dsums/dL_i-factor common to every axis: g 2 F^2 L
        common = grad * (2.0 * _f_squared(hkl0, F_grid, hkl_min, hkl_max, default_F)) * (f[0] * others[0])
        E = real_A.shape[0] * real_A.shape[1]
        X = sx.numel()
        grad_S = grad_real = grad_n = None
        if need_s or need_a:
            G = torch.stack([(common * others[i] * parts[i][1]).reshape(E, X) for i in range(3)], 1)  # (E, 3, X)
            if need_a:  # an Inductor reduction over pixels (a BLAS product with 3 columns is slower)
                S = torch.stack((sx, sy, sz), 0).reshape(1, 1, 3, X)
                grad_real = (G.reshape(E, 3, 1, X) * S).sum(-1).reshape(real_A.shape)
            if need_s:  # a matrix product (an Inductor reduction over the outer axis is slower)
                grad_S = real_A.reshape(E * 3, 3).transpose(0, 1) @ G.reshape(E * 3, X)  # (3, X)
        if need_n:
            grad_n = torch.stack([(common * others[i] * parts[i][2]).sum() for i in range(3)])
        gs = [None if grad_S is None else grad_S[j].reshape(sx.shape) for j in range(3)]
        return gs[0], gs[1], gs[2], grad_real, grad_n, None, None, None, None


def square_orientation_sum(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F) -> Tensor:
    """:class:`SquareOrientationSum`; without a table (``F_grid`` None) the sum is of ``L^2`` alone.

    ``F_grid``, ``hkl_min``, ``hkl_max`` and ``default_F`` enter without gradient.
    """
    return SquareOrientationSum.apply(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F)
