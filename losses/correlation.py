"""Normalized cross-correlation loss (scale- and offset-invariant image match).

``normalized_cross_correlation`` returns ``1 - NCC`` so that 0 is a perfect
match (up to a positive scale and an additive offset), 1 means uncorrelated and
2 anti-correlated.  With weights ``w`` (0 on masked pixels) and sums over the
correlation dims::

    m' = m - sum(w m) / sum(w),   o' = o - sum(w o) / sum(w)
    NCC = sum(w m' o') / sqrt(sum(w m'^2) * sum(w o'^2))

Units: any (the result is dimensionless).  Shapes: ``model``, ``observed``,
``mask`` share one shape S; ``weights`` broadcasts to S; ``dim`` selects the
dims correlated together (default all of them).  Reductions over the remaining
dims R: ``'none'`` -> R, ``'mean'`` / ``'sum'`` -> scalar (unweighted mean/sum of
the per-slice values).

Constant images: each variance is floored at about ``(4 eps)^2 * mean(w x^2)``
(``eps`` the dtype's machine epsilon, i.e. the round-off level of the
variance), so a constant ``model`` or ``observed`` gives a loss of 1 (no
correlation) with finite gradients instead of 0/0.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from losses._common import check_reduction, prepare
from nbtorch.errors import InputError

__all__ = ["normalized_cross_correlation", "NCCLoss"]


def _dims(dim: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise InputError(f"dim: {d} is out of range for a tensor with {ndim} dims")
        out.append(d % ndim)
    if len(set(out)) != len(out) or not out:
        raise InputError(f"dim: expected one or more distinct dims, got {dim!r}")
    return tuple(out)


def normalized_cross_correlation(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
    dim: int | tuple[int, ...] | None = None,
) -> Tensor:
    """``1 - NCC`` between ``model`` and ``observed`` over ``dim`` (weighted, masked).

    Arguments:
        model: floating tensor of shape S.
        observed: shape S.
        mask: bool, shape S, True = use pixel; each slice needs an unmasked pixel.
        weights: broadcastable to S, >= 0; each slice needs a positive total weight.
        reduction: ``'mean'`` | ``'sum'`` | ``'none'`` over the dims not in ``dim``.
        dim: dims correlated together; None = all (one correlation).

    Returns: scalar, or the per-slice values (S without ``dim``) for ``'none'``.
    """
    check_reduction(reduction)
    p = prepare(model, observed, mask, weights, fill=0.0)
    dims = _dims(dim, p.model.ndim) if p.model.ndim else ()
    if dims and not bool(p.mask.any(dim=dims).all()):
        raise InputError("mask: all pixels are masked out in at least one slice")
    total = p.weights.sum(dim=dims, keepdim=True) if dims else p.weights
    if not bool((total > 0).all()):
        raise InputError("weights: total weight over unmasked pixels is zero in at least one slice")

    def wmean(x: Tensor) -> Tensor:
        return (p.weights * x).sum(dim=dims, keepdim=True) / total if dims else x

    dm = p.model - wmean(p.model)
    do = p.observed - wmean(p.observed)
    cov = wmean(dm * do)
    eps = torch.finfo(p.model.dtype).eps
    tiny = torch.finfo(p.model.dtype).tiny
    floor_m = ((4 * eps) ** 2 * wmean(p.model**2) + tiny).detach()
    floor_o = ((4 * eps) ** 2 * wmean(p.observed**2) + tiny).detach()
    var_m = torch.maximum(wmean(dm * dm), floor_m)
    var_o = torch.maximum(wmean(do * do), floor_o)
    loss = 1.0 - cov / (torch.sqrt(var_m) * torch.sqrt(var_o))  # no underflow of the product
    if dims:
        loss = loss.squeeze(dims)
    if reduction == "none":
        return loss
    return loss.mean() if reduction == "mean" else loss.sum()


class NCCLoss(nn.Module):
    """Module form of :func:`normalized_cross_correlation` (returns ``1 - NCC``)."""

    def __init__(self, reduction: str = "mean", dim: int | tuple[int, ...] | None = None) -> None:
        super().__init__()
        check_reduction(reduction)
        self.reduction, self.dim = reduction, dim

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None) -> Tensor:
        return normalized_cross_correlation(model, observed, mask, weights, self.reduction, self.dim)
