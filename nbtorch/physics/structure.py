"""Structure-factor lookup F_cell(h, k, l).

The table is a dense grid ``F[h - h_min, k - k_min, l - l_min]`` prefilled with
``default_F`` (as nanoBragg does); indices outside the grid get ``default_F``.

* nearest neighbour: ``F[h0, k0, l0]`` with ``h0 = ceil(h - 0.5)``; piecewise
  constant in h, k, l (zero derivative with respect to the indices; the
  derivative with respect to the table entries is one-hot);
* tricubic: 4-point Lagrange interpolation on the integer nodes
  ``floor(h) - 1 .. floor(h) + 2`` in each direction (nanoBragg's ``polin3``);
  smooth in h, k, l.  Usable only where the whole 4x4x4 stencil lies inside
  the grid: ``h - 2 >= h_min`` and ``h + 3 <= h_max + 1`` (and likewise for k, l).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _components(x: Tensor | tuple) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(x) if isinstance(x, (tuple, list)) else x.unbind(-1)  # type: ignore[return-value]


def in_grid(hkl0, hkl_min: Tensor, hkl_max: Tensor) -> Tensor:
    """Whether integer indices ((..., 3) or an (h0, k0, l0) tuple) lie inside [min, max] in every direction.

    Component by component (no stacking: it fuses into the loops that use it).
    """
    inside = None
    for x, lo, hi in zip(_components(hkl0), hkl_min.unbind(-1), hkl_max.unbind(-1)):
        ok = (x >= lo) & (x <= hi)
        inside = ok if inside is None else inside & ok
    return inside


def interpolation_safe(hkl, hkl_min: Tensor, hkl_max: Tensor) -> Tensor:
    """Where the tricubic stencil of fractional ``hkl`` ((..., 3) or a tuple) lies inside the grid (C's test)."""
    span = hkl_max - hkl_min + 1
    ok = None
    for x, lo, n in zip(_components(hkl), hkl_min.unbind(-1), span.unbind(-1)):
        inside = ~(((x - lo + 3) > n) | (x - 2 < lo))
        ok = inside if ok is None else ok & inside
    return ok


def _gather(grid: Tensor, idx: Tensor) -> Tensor:
    """grid[(i, j, k)] for integer index tensor idx (..., 3), clamped to the grid."""
    nh, nk, nl = grid.shape
    i = idx[..., 0].clamp(0, nh - 1)
    j = idx[..., 1].clamp(0, nk - 1)
    k = idx[..., 2].clamp(0, nl - 1)
    flat = (i * nk + j) * nl + k
    return grid.reshape(-1)[flat]


def nearest_structure_factor(hkl0, grid: Tensor, hkl_min: Tensor, hkl_max: Tensor, default_F: Tensor) -> Tensor:
    """Nearest-neighbour F for integer indices hkl0: (..., 3) or an (h0, k0, l0) tuple (floating dtype)."""
    h0, k0, l0 = _components(hkl0)
    inside = in_grid((h0, k0, l0), hkl_min, hkl_max)
    nh, nk, nl = grid.shape
    i = (h0 - hkl_min[0]).long().clamp(0, nh - 1)
    j = (k0 - hkl_min[1]).long().clamp(0, nk - 1)
    k = (l0 - hkl_min[2]).long().clamp(0, nl - 1)
    values = grid.reshape(-1)[(i * nk + j) * nl + k]
    return torch.where(inside, values, default_F)


def _lagrange_weights(t: Tensor) -> Tensor:
    """Weights (..., 4) of nodes -1, 0, 1, 2 at fractional position t in [0, 1)."""
    tm1, tp1, tm2 = t - 1.0, t + 1.0, t - 2.0
    return torch.stack(
        (
            -t * tm1 * tm2 / 6.0,
            tp1 * tm1 * tm2 / 2.0,
            -tp1 * t * tm2 / 2.0,
            tp1 * t * tm1 / 6.0,
        ),
        -1,
    )


def _stencil_offsets(shape: tuple[int, int, int], device) -> Tensor:
    """(4, 4, 4) flat-index offsets of a tricubic stencil's nodes from its first node in a grid of ``shape``."""
    _, nk, nl = shape
    a = torch.arange(4, device=device)
    return (a[:, None, None] * nk + a[None, :, None]) * nl + a


def tricubic_structure_factor(hkl, grid: Tensor, hkl_min: Tensor) -> Tensor:
    """Tricubic-interpolated F at fractional hkl ((..., 3) or a tuple).

    The caller keeps the result only where the stencil lies inside the grid (:func:`interpolation_safe`);
    elsewhere the stencil is shifted inside (a finite value the caller discards).  The 64 nodes are one
    flat offset table added to each stencil's first node; eager contracts them with the weights as two
    batched matrix products (BLAS), a compiled graph as products and sums that fuse into its loop.
    """
    if isinstance(hkl, (tuple, list)):
        hkl = torch.stack(tuple(hkl), -1)
    base = torch.floor(hkl)
    w = _lagrange_weights(hkl - base)  # (..., 3, 4)
    nh, nk, nl = grid.shape
    first = (base.detach() - hkl_min).long() - 1  # (..., 3): the stencil's first node
    # each axis's first node in [0, n - 4]; plain integers, no tensor made from Python data (a CUDA graph's rule)
    fh, fk, fl = (first[..., i].clamp(min=0).clamp(max=max(n - 4, 0)) for i, n in enumerate(grid.shape))
    start = fh * (nk * nl) + fk * nl + fl
    flat = start[..., None, None, None] + _stencil_offsets(grid.shape, hkl.device)  # (..., 4, 4, 4)
    if min(grid.shape) < 4:  # no point is safe; keep the discarded ones' lookups inside the table
        flat = flat.clamp(max=grid.numel() - 1)
    vals = grid.reshape(-1)[flat]
    if torch.compiler.is_compiling():
        vals = (vals * w[..., 2, None, None, :]).sum(-1)
        vals = (vals * w[..., 1, None, :]).sum(-1)
        return (vals * w[..., 0, :]).sum(-1)
    wi, wj, wk = w.reshape(-1, 3, 4).unbind(1)
    vals = torch.bmm(vals.reshape(-1, 16, 4), wk.unsqueeze(-1)).reshape(-1, 4, 4)
    vals = torch.bmm(vals, wj.unsqueeze(-1)).reshape(-1, 4)
    return (vals * wi).sum(-1).reshape(hkl.shape[:-1])


def structure_factor(
    hkl,
    hkl0,
    grid: Tensor | None,
    hkl_min: Tensor | None,
    hkl_max: Tensor | None,
    default_F: Tensor,
    interpolate: bool,
) -> Tensor:
    """F_cell for each evaluation.

    Arguments:
        hkl, hkl0: (..., 3) fractional and nearest-integer indices (or (h, k, l) tuples).
        grid: (nh, nk, nl) table or None (no HKL file: every F is default_F).
        hkl_min, hkl_max: (3,) index bounds of the grid (same dtype as hkl).
        default_F: F for reflections outside (or missing from) the table.
        interpolate: tricubic where the stencil is inside the grid, default_F
            elsewhere (spec behaviour; the C-parity global switch-off is handled
            by the caller).
    """
    if grid is None:
        h = _components(hkl)[0]
        return default_F.expand(h.shape)
    if not interpolate:
        return nearest_structure_factor(hkl0, grid, hkl_min, hkl_max, default_F)
    safe = interpolation_safe(hkl, hkl_min, hkl_max)
    return torch.where(safe, tricubic_structure_factor(hkl, grid, hkl_min), default_F)
