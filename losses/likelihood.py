"""Negative log-likelihood losses for photon-counting images.

Units: ``model`` is the expected number of photons per pixel (>= 0),
``observed`` the measured counts per pixel (same units; need not be integer).
Shapes: ``model``, ``observed`` and ``mask`` share one shape S (any rank);
``weights`` broadcasts to S.  Reductions (see :mod:`losses._common`):
``'none'`` -> S (zeros on masked pixels), ``'sum'`` -> scalar,
``'mean'`` -> scalar weighted mean over unmasked pixels.

* :func:`poisson_deviance`: the half Poisson deviance ``model - observed + observed * log(observed / model)``
  (0 for a perfect fit; what ``"poisson"`` means everywhere: :func:`losses.get_loss`, the refinement).
* :func:`poisson_nll`: ``model - observed * log(model)``
  (``+ lgamma(observed + 1)`` with ``full=True``); same gradient as the deviance.
* :func:`gaussian_nll`: ``0.5 * ((model - observed)^2 / var + log var)``
  (``+ 0.5 * log(2 pi)`` with ``full=True``), ``var`` defaulting to the
  Poisson-plus-readout variance ``model + readout_sigma^2``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from losses._common import check_reduction, dtype_eps, prepare, reduce
from losses.kernels import gaussian_nll_terms, poisson_deviance_terms, poisson_nll_terms
from nbtorch.errors import InputError

__all__ = ["poisson_deviance", "poisson_nll", "gaussian_nll", "PoissonDeviance", "PoissonNLL", "GaussianNLL"]


def poisson_deviance(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
    eps: float | None = None,
) -> Tensor:
    """Half Poisson deviance of ``observed`` counts given expected ``model`` photons.

    Per pixel: ``model - observed + observed * log(observed / model)`` (``0 log 0 = 0``): zero for a perfect fit,
    about 1/2 per pixel for a right model with Poisson noise; it differs from :func:`poisson_nll` by a constant
    per pixel, so both have the same gradient.  ``log(model)`` below ``eps`` as in :func:`poisson_nll`.

    Arguments: as :func:`poisson_nll` (no ``full``).  Returns: scalar, or shape S for ``reduction='none'``.
    """
    check_reduction(reduction)
    p = prepare(model, observed, mask, weights)
    return reduce(poisson_deviance_terms(p.model, p.observed, dtype_eps(p.model.dtype, eps)), p, reduction)


def poisson_nll(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
    full: bool = False,
    eps: float | None = None,
) -> Tensor:
    """Poisson negative log-likelihood of ``observed`` counts given expected ``model`` photons.

    Per pixel: ``model - observed * log(model)``, plus ``lgamma(observed + 1)``
    when ``full`` (this makes the loss the exact NLL; it has no gradient
    w.r.t. ``model``).  Where ``observed == 0`` the log term is exactly 0 with
    zero gradient, whatever ``model`` is.  Below ``eps`` (default
    ``max(1e-12, finfo(dtype).tiny)``) ``log(model)`` is replaced by its tangent
    line at ``eps``, so ``model == 0`` gives a finite loss and a finite gradient
    ``1 - observed / eps`` that pushes ``model`` up when ``observed > 0``.

    Arguments:
        model: expected photons, floating tensor of shape S (>= 0 expected).
        observed: counts, shape S.
        mask: bool, shape S, True = use pixel.
        weights: broadcastable to S, >= 0.
        reduction: ``'mean'`` | ``'sum'`` | ``'none'``.
        full: add the ``lgamma(observed + 1)`` constant.
        eps: log floor, photons.

    Returns: scalar, or shape S for ``reduction='none'``.
    """
    check_reduction(reduction)
    p = prepare(model, observed, mask, weights)
    per_pixel = poisson_nll_terms(p.model, p.observed, dtype_eps(p.model.dtype, eps))
    if full:
        per_pixel = per_pixel + torch.lgamma(p.observed + 1.0)
    return reduce(per_pixel, p, reduction)


def gaussian_nll(
    model: Tensor,
    observed: Tensor,
    variance: Tensor | float | None = None,
    readout_sigma: float = 0.0,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
    full: bool = False,
    eps: float | None = None,
) -> Tensor:
    """Gaussian negative log-likelihood: ``0.5 * ((model - observed)^2 / var + log var)``.

    ``var`` is ``variance`` when given (tensor broadcastable to S, or a number),
    else ``model + readout_sigma^2`` (photon shot noise plus read-out noise,
    photons^2; gradients then flow through the variance too).  ``var`` is
    clamped to at least ``eps`` (default ``max(1e-12, finfo(dtype).tiny)``).
    ``full`` adds ``0.5 * log(2 pi)`` per pixel.

    Arguments:
        model: expected photons, floating tensor of shape S.
        observed: counts, shape S.
        variance: per-pixel variance (photons^2), or None for the default.
        readout_sigma: read-out noise (photons), used only when ``variance`` is None.
        mask, weights, reduction: as for :func:`poisson_nll`.

    Returns: scalar, or shape S for ``reduction='none'``.
    """
    check_reduction(reduction)
    p = prepare(model, observed, mask, weights)
    floor = dtype_eps(p.model.dtype, eps)
    if variance is None:
        if not float(readout_sigma) >= 0:
            raise InputError(f"readout_sigma: must be >= 0, got {readout_sigma!r}")
        var = p.model + float(readout_sigma) ** 2
    else:
        var = torch.as_tensor(variance, dtype=p.model.dtype, device=p.model.device)
        try:
            ok = torch.broadcast_shapes(var.shape, p.model.shape) == p.model.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise InputError(f"variance: shape {tuple(var.shape)} does not broadcast to model shape {tuple(p.model.shape)}")
        var = torch.where(p.mask, var, torch.ones((), dtype=var.dtype, device=var.device))
    per_pixel = gaussian_nll_terms(p.model, p.observed, torch.clamp(var, min=floor))
    if full:
        per_pixel = per_pixel + 0.5 * math.log(2.0 * math.pi)
    return reduce(per_pixel, p, reduction)


class PoissonDeviance(nn.Module):
    """Module form of :func:`poisson_deviance` (registry name ``"poisson"``)."""

    def __init__(self, reduction: str = "mean", eps: float | None = None) -> None:
        super().__init__()
        check_reduction(reduction)
        self.reduction, self.eps = reduction, eps

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None) -> Tensor:
        return poisson_deviance(model, observed, mask, weights, self.reduction, self.eps)


class PoissonNLL(nn.Module):
    """Module form of :func:`poisson_nll`; keyword options are fixed at construction."""

    def __init__(self, reduction: str = "mean", full: bool = False, eps: float | None = None) -> None:
        super().__init__()
        check_reduction(reduction)
        self.reduction, self.full, self.eps = reduction, full, eps

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None) -> Tensor:
        return poisson_nll(model, observed, mask, weights, self.reduction, self.full, self.eps)


class GaussianNLL(nn.Module):
    """Module form of :func:`gaussian_nll`; a per-pixel ``variance`` may be passed to forward."""

    def __init__(self, readout_sigma: float = 0.0, reduction: str = "mean", full: bool = False,
                 eps: float | None = None) -> None:
        super().__init__()
        check_reduction(reduction)
        self.readout_sigma, self.reduction, self.full, self.eps = readout_sigma, reduction, full, eps

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None, variance: Tensor | float | None = None) -> Tensor:
        return gaussian_nll(model, observed, variance, self.readout_sigma, mask, weights,
                            self.reduction, self.full, self.eps)
