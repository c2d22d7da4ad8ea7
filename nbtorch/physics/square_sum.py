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
    grad default_F    = sum_{e,x} g 2 default_F L^2 [F is default_F there]

``F`` is the nearest-neighbour lookup (piecewise constant in h; ``default_F``
outside the table, or everywhere without one); the table itself enters without
gradient: callers use this only when it needs none and the crystal shape is
``square`` (see :func:`~nbtorch.physics.kernel.analytic_orientation_sum`).
Shapes: ``s*`` (..., P), ``real_A`` (Φ, M, 3, 3) rows a, b, c (Angstrom),
``n_cells`` (3,), ``default_F`` ().

The forward and the backward are two pure functions (:func:`square_sum`,
:func:`square_sum_backward`) that :class:`SquareOrientationSum` calls, so the
compiled simulator compiles each apart, each with its own Inductor options
(traced together by AOTAutograd, the forward's fusion options would also
apply to the backward, which then takes minutes to compile).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from nbtorch.physics.lattice import (
    lattice_factor_components, miller_indices, nearest_index, sincg_reduced_derivatives,
)
from nbtorch.physics.structure import in_grid, nearest_structure_factor


def _f_and_default(hkl0: list[Tensor], F_grid, hkl_min, hkl_max, default_F) -> tuple[Tensor, Tensor | None]:
    """``F`` per evaluation and where it is ``default_F`` (None: everywhere)."""
    if F_grid is None:
        return default_F, None
    f = nearest_structure_factor(tuple(hkl0), F_grid, hkl_min, hkl_max, default_F)
    return f, ~in_grid(tuple(hkl0), hkl_min, hkl_max)


def square_sum(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F) -> Tensor:
    """``sum over (Φ, M) of F^2 L^2`` (the forward; plain tensor code)."""
    hkl = miller_indices((sx, sy, sz), real_A)
    hkl0 = tuple(nearest_index(h) for h in hkl)
    latt = lattice_factor_components(hkl, hkl0, n_cells, "square")
    f = _f_and_default(list(hkl0), F_grid, hkl_min, hkl_max, default_F)[0]
    return ((f * latt) ** 2).reshape((-1,) + tuple(sx.shape)).sum(0)


def square_sum_factors(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F, need_n: bool) -> tuple:
    """What :func:`square_sum`'s derivatives share: ``(hkl0, parts, others, latt, F, defaulted)`` with ``hkl0``
    the nearest Miller indices, ``parts[i]`` the reduced ``sincg`` of axis ``i`` and its derivatives (in ``h`` and,
    with ``need_n``, in ``N``), ``others[i]`` the product of the other two axes' factors, ``latt`` the lattice
    factor, ``F`` the structure factors and ``defaulted`` where they follow ``default_F`` (or None)."""
    hkl = list(miller_indices((sx, sy, sz), real_A))
    hkl0 = [nearest_index(h) for h in hkl]
    parts = [sincg_reduced_derivatives(hkl[i] - hkl0[i], n_cells[i], need_n) for i in range(3)]
    f = [p[0] for p in parts]
    others = (f[1] * f[2], f[0] * f[2], f[0] * f[1])
    latt = f[0] * others[0]
    F, defaulted = _f_and_default(hkl0, F_grid, hkl_min, hkl_max, default_F)
    return hkl0, parts, others, latt, F, defaulted


def square_sum_backward(grad, sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F,
                        need_s: bool, need_a: bool, need_n: bool, need_f: bool) -> tuple:
    """Gradients ``(sx, sy, sz, real_A, n_cells, default_F)`` of :func:`square_sum` for upstream ``grad``.

    Those not asked for (``need_*``) are None and cost nothing.
    """
    hkl0, parts, others, latt, F, defaulted = square_sum_factors(sx, sy, sz, real_A, n_cells, F_grid, hkl_min,
                                                                 hkl_max, default_F, need_n)
    common = grad * (2.0 * F * F) * latt  # dsums/dL_i-factor common to every axis: g 2 F^2 L
    E = real_A.shape[0] * real_A.shape[1]
    X = sx.numel()
    grad_S = grad_real = grad_n = grad_f = None
    if need_s or need_a:
        G = torch.stack([(common * others[i] * parts[i][1]).reshape(E, X) for i in range(3)], 1)  # (E, 3, X)
        if need_a:  # an Inductor reduction over pixels (a BLAS product with 3 columns is slower)
            S = torch.stack((sx, sy, sz), 0).reshape(1, 1, 3, X)
            grad_real = (G.reshape(E, 3, 1, X) * S).sum(-1).reshape(real_A.shape)
        if need_s:  # a matrix product (an Inductor reduction over the outer axis is slower)
            grad_S = real_A.reshape(E * 3, 3).transpose(0, 1) @ G.reshape(E * 3, X)  # (3, X)
    if need_n:
        grad_n = torch.stack([(common * others[i] * parts[i][2]).sum() for i in range(3)])
    if need_f:
        d = grad * (2.0 * default_F) * latt * latt
        grad_f = (d if defaulted is None else torch.where(defaulted, d, torch.zeros_like(d))).sum()
    gs = [None if grad_S is None else grad_S[j].reshape(sx.shape) for j in range(3)]
    return gs[0], gs[1], gs[2], grad_real, grad_n, grad_f


def square_sum_jvp(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F,
                   d_s: tuple | None, d_real, d_n, d_f, d_grid=None) -> Tensor:
    """The tangent of :func:`square_sum` (forward mode) for the tangents ``d_s`` (of ``sx, sy, sz``), ``d_real``,
    ``d_n``, ``d_f`` and ``d_grid`` (of the table; None: zero), with the factors of :func:`square_sum_backward` left unreduced over pixels::

        d sums[x] = sum_j grad_S_j[x] dS_j[x] + sum_{e,i,j} G_i[e, x] S_j[x] dA_ij(e)
                    + sum_i D_i[x] dN_i + Fd[x] d default_F

    Under :func:`torch.func.jacfwd` the tangents carry a batch of P directions: the factors above are
    computed once, each direction then costs a few products (a matrix product for ``dA``).
    """
    hkl0, parts, others, latt, F, defaulted = square_sum_factors(sx, sy, sz, real_A, n_cells, F_grid, hkl_min,
                                                                 hkl_max, default_F, d_n is not None)
    common = (2.0 * F * F) * latt
    E, X = real_A.shape[0] * real_A.shape[1], sx.numel()
    out = sx.new_zeros(X)
    if d_s is not None or d_real is not None:
        G = torch.stack([(common * others[i] * parts[i][1]).reshape(E, X) for i in range(3)], 1)  # (E, 3, X)
        if d_s is not None:
            grad_S = real_A.reshape(E * 3, 3).transpose(0, 1) @ G.reshape(E * 3, X)  # (3, X)
            out = out + sum(grad_S[j] * d_s[j].reshape(X) for j in range(3))
        if d_real is not None:
            S = torch.stack((sx, sy, sz), 0).reshape(1, 1, 3, X)
            W = (G.reshape(E, 3, 1, X) * S).reshape(E * 9, X)
            out = out + d_real.reshape(1, E * 9) @ W
    if d_n is not None:
        for i in range(3):
            out = out + (common * others[i] * parts[i][2]).reshape(E, X).sum(0) * d_n[i]
    if d_f is not None:
        d = (2.0 * default_F) * latt * latt
        d = d if defaulted is None else torch.where(defaulted, d, torch.zeros_like(d))
        out = out + d.reshape(E, X).sum(0) * d_f
    if d_grid is not None:  # the table's own entries (e.g. reflections that follow default_F)
        dF = nearest_structure_factor(tuple(hkl0), d_grid, hkl_min, hkl_max, torch.zeros_like(default_F))
        out = out + ((2.0 * F * latt * latt) * dF).reshape(E, X).sum(0)
    return out.reshape(sx.shape)


class SquareOrientationSum(torch.autograd.Function):
    """``sum over (Φ, M) of F^2 L^2``; differentiable in S, real_A, N and default_F, in reverse mode
    (:func:`square_sum_backward`) and forward mode (:func:`square_sum_jvp`, also under
    :func:`torch.func.jacfwd`).

    ``forward_fn(sx, sy, sz, real_A, n_cells, default_F)`` returns ``(sums, *extra)``
    (``extra``: tensors without gradient, e.g. diagnostics), run without
    gradients; ``backward_fn`` has the signature of :func:`square_sum_backward`.
    """

    generate_vmap_rule = True  # jacfwd: the tangents batched

    @staticmethod
    def forward(sx, sy, sz, real_A, n_cells, default_F, F_grid, hkl_min, hkl_max, forward_fn,  # type: ignore[override]
                backward_fn):
        if forward_fn is None:
            return (square_sum(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F),)
        return tuple(forward_fn(sx, sy, sz, real_A, n_cells, default_F))

    @staticmethod
    def setup_context(ctx, inputs, output):
        sx, sy, sz, real_A, n_cells, default_F, F_grid, hkl_min, hkl_max, _, backward_fn = inputs
        ctx.save_for_backward(sx, sy, sz, real_A, n_cells, default_F)
        ctx.save_for_forward(sx, sy, sz, real_A, n_cells, default_F, F_grid, hkl_min, hkl_max)
        ctx.table, ctx.backward_fn, ctx.n_extra = (F_grid, hkl_min, hkl_max), backward_fn, len(output) - 1
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, grad, *_):  # type: ignore[override]
        sx, sy, sz, real_A, n_cells, default_F = ctx.saved_tensors
        need = ctx.needs_input_grad
        grads = ctx.backward_fn(grad, sx, sy, sz, real_A, n_cells, *ctx.table, default_F,
                                any(need[:3]), need[3], need[4], need[5])
        return (*grads, None, None, None, None, None)

    @staticmethod
    def jvp(ctx, d_sx, d_sy, d_sz, d_real, d_n, d_f, d_grid, *_):  # type: ignore[override]
        sx, sy, sz, real_A, n_cells, default_F, F_grid, hkl_min, hkl_max = ctx.saved_tensors
        d_s = None
        if not (d_sx is None and d_sy is None and d_sz is None):
            d_s = tuple(torch.zeros_like(sx) if d is None else d for d in (d_sx, d_sy, d_sz))
        tangent = square_sum_jvp(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F, d_s, d_real,
                                 d_n, d_f, d_grid)
        return (tangent, *([None] * ctx.n_extra))


def square_orientation_sum(sx, sy, sz, real_A, n_cells, F_grid, hkl_min, hkl_max, default_F,
                           forward_fn: Callable | None = None,
                           backward_fn: Callable = square_sum_backward) -> tuple[Tensor, ...]:
    """:class:`SquareOrientationSum`: ``(sums, *extra)``; ``F_grid`` None means every F is ``default_F``.

    Without ``forward_fn`` the forward is :func:`square_sum` (no extras).  The
    table (``F_grid``, ``hkl_min``, ``hkl_max``) enters without gradient.
    """
    return SquareOrientationSum.apply(sx, sy, sz, real_A, n_cells, default_F, F_grid, hkl_min, hkl_max, forward_fn,
                                      backward_fn)
