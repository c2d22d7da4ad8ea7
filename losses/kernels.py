"""Check-free loss kernels: pure tensor arithmetic, no validation, no data-dependent Python branches.

These are the losses themselves; the public functions of :mod:`losses.likelihood`,
:mod:`losses.regression` and the modules of :mod:`losses.registry` validate their inputs
(:mod:`losses._common`: shapes, masks, weights, options, one-line errors) and then call a kernel.
Code that evaluates a loss many times on inputs it has already checked, inside compiled graphs
(``torch.compile(fullgraph=True)``) included, calls the kernels directly: the refinement's
objective does (:func:`poisson_deviance`, :data:`PIXEL_TERMS`).

Per-pixel kernels take ``model`` (expected photons) and ``observed`` (counts) of one shape and
return the per-pixel loss of that shape.  Every pixel must hold finite values: the callers put a
harmless value on pixels they ignore (zero weight) before calling, so no NaN can leak through a
zero weight into a sum or a gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["DEFAULT_EPS", "safe_log", "poisson_nll_terms", "poisson_deviance_terms", "gaussian_nll_terms",
           "squared_error_terms", "huber_terms", "log_intensity_terms", "gaussian_restraint_terms", "poisson_deviance",
           "PIXEL_TERMS"]

#: the log floor of the Poisson kernels (photons) when the caller gives none
DEFAULT_EPS = 1e-12


def safe_log(x: Tensor, eps: float) -> Tensor:
    """``log(x)`` for ``x >= eps``; below ``eps`` its tangent at ``eps``, ``log(eps) + (x - eps) / eps``.

    Finite everywhere, continuous with a continuous first derivative, and (unlike a plain clamp) its
    gradient stays positive below ``eps``.
    """
    xc = torch.clamp(x, min=eps)
    return torch.where(x >= eps, torch.log(xc), math.log(eps) + (x - eps) / eps)


def poisson_nll_terms(model: Tensor, observed: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Poisson negative log-likelihood per pixel, without the constant ``lgamma(k + 1)``: ``m - k log m``."""
    return model - observed * safe_log(model, eps)


def poisson_deviance_terms(model: Tensor, observed: Tensor, eps: float = DEFAULT_EPS) -> Tensor:
    """Half Poisson deviance per pixel: ``m - k + k log(k / m)`` (0 for ``m = k``; ``k log k = 0`` at ``k = 0``).

    Its gradient in ``m`` is that of :func:`poisson_nll_terms`; it differs from it by a constant per pixel.
    """
    return model - observed + torch.special.xlogy(observed, observed) - observed * safe_log(model, eps)


def gaussian_nll_terms(model: Tensor, observed: Tensor, variance: Tensor) -> Tensor:
    """Gaussian negative log-likelihood per pixel (without ``0.5 log 2 pi``): ``0.5 ((m - k)^2 / v + log v)``;
    ``variance`` is already floored by the caller."""
    return 0.5 * ((model - observed) ** 2 / variance + torch.log(variance))


def squared_error_terms(model: Tensor, observed: Tensor) -> Tensor:
    """``(m - k)^2``."""
    return (model - observed) ** 2


def huber_terms(model: Tensor, observed: Tensor, delta: float = 1.0) -> Tensor:
    """Huber loss of ``r = m - k``: ``0.5 r^2`` for ``|r| <= delta``, else ``delta (|r| - delta / 2)``."""
    return torch.nn.functional.huber_loss(model, observed, reduction="none", delta=float(delta))


def log_intensity_terms(model: Tensor, observed: Tensor, offset: float = 1.0, eps: float = DEFAULT_EPS) -> Tensor:
    """``(log(m + offset) - log(k + offset))^2``, ``m + offset`` floored at ``eps``; ``k + offset > 0`` is the
    caller's to ensure."""
    return (torch.log(torch.clamp(model + offset, min=eps)) - torch.log(observed + offset)) ** 2


def gaussian_restraint_terms(value: Tensor, target: Tensor | float, sigma: Tensor | float) -> Tensor:
    """``0.5 ((value - target) / sigma)^2`` elementwise: the negative log of a Gaussian prior (``sigma > 0``)."""
    return 0.5 * ((value - target) / sigma) ** 2


def poisson_deviance(model: Tensor, observed: Tensor, weights: Tensor) -> Tensor:
    """``sum w (m - k + k log(k / m))`` (scalar): the refinement's default loss.

    Arguments:
        model: expected photons ``m`` (any shape S, > 0 where ``w > 0``).
        observed: counts ``k`` (shape S, >= 0 where ``w > 0``).
        weights: ``w`` (shape S, 0 = ignore the pixel; ignored pixels may hold anything finite).

    It is 0 for a perfect fit, about half the number of pixels for a right model with Poisson noise,
    and a change of 0.5 is one standard deviation of a single parameter.  Below ``m = 1e-12`` the log
    is continued by its tangent (finite loss and gradient).
    """
    k = torch.where(weights > 0, observed, torch.zeros_like(observed))
    return (weights * poisson_deviance_terms(model, k)).sum()


poisson_deviance.pixelwise = True  # a sum over pixels: a caller may pass only the pixels it fits

#: registry name -> per-pixel kernel with the registry module's default options (the names whose loss is a
#: sum over pixels; ``ncc`` is not: it is a correlation over all of them)
PIXEL_TERMS = {
    "poisson": poisson_deviance_terms,
    "poisson_nll": poisson_nll_terms,
    "gaussian": lambda model, observed: gaussian_nll_terms(model, observed, torch.clamp(model, min=DEFAULT_EPS)),
    "mse": squared_error_terms,
    "huber": huber_terms,
    "log": log_intensity_terms,
}
