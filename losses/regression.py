"""Least-squares style image losses.

Units: ``model`` and ``observed`` in the same intensity units (photons per
pixel for the simulator).  Shapes: ``model``, ``observed``, ``mask`` share one
shape S; ``weights`` broadcasts to S.  Reductions (see :mod:`losses._common`):
``'none'`` -> S (zeros on masked pixels), ``'sum'`` -> scalar, ``'mean'`` ->
scalar weighted mean over unmasked pixels.

* :func:`weighted_mse`: ``(model - observed)^2``.
* :func:`huber`: ``0.5 r^2`` for ``|r| <= delta``, else ``delta (|r| - delta / 2)``,
  ``r = model - observed`` (``delta`` in intensity units).
* :func:`log_intensity_mse`: ``(log(model + offset) - log(observed + offset))^2``;
  compresses the dynamic range so weak pixels and strong spots count alike.
"""

from __future__ import annotations

from torch import Tensor, nn

from losses._common import check_positive, check_reduction, dtype_eps, prepare, reduce
from losses.kernels import huber_terms, log_intensity_terms, squared_error_terms
from nbtorch.errors import InputError

__all__ = ["weighted_mse", "huber", "log_intensity_mse", "WeightedMSE", "Huber", "LogIntensityMSE"]


def weighted_mse(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Weighted squared error ``weights * (model - observed)^2``, reduced over unmasked pixels.

    Returns: scalar, or shape S for ``reduction='none'``.
    """
    check_reduction(reduction)
    p = prepare(model, observed, mask, weights)
    return reduce(squared_error_terms(p.model, p.observed), p, reduction)


def huber(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
    delta: float = 1.0,
) -> Tensor:
    """Huber loss of ``r = model - observed``: quadratic for ``|r| <= delta``, linear beyond.

    Per pixel ``0.5 r^2`` if ``|r| <= delta`` else ``delta * (|r| - 0.5 delta)``
    (continuous with continuous gradient; ``delta > 0`` in intensity units).

    Returns: scalar, or shape S for ``reduction='none'``.
    """
    check_reduction(reduction)
    check_positive("delta", delta)
    p = prepare(model, observed, mask, weights)
    return reduce(huber_terms(p.model, p.observed, float(delta)), p, reduction)


def log_intensity_mse(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None = None,
    weights: Tensor | float | None = None,
    reduction: str = "mean",
    offset: float = 1.0,
) -> Tensor:
    """Squared error of log intensities: ``(log(model + offset) - log(observed + offset))^2``.

    ``offset > 0`` (intensity units) keeps the log finite at zero counts;
    ``observed + offset`` must be > 0 on unmasked pixels.  ``model + offset``
    is floored at ``max(1e-12, finfo(dtype).tiny)`` so a negative ``model``
    cannot give NaN.

    Returns: scalar, or shape S for ``reduction='none'``.
    """
    check_reduction(reduction)
    check_positive("offset", offset)
    p = prepare(model, observed, mask, weights)
    off = float(offset)
    if bool(((p.observed + off) <= 0).any()):
        raise InputError(f"observed: observed + offset must be > 0 on unmasked pixels (offset={off})")
    return reduce(log_intensity_terms(p.model, p.observed, off, dtype_eps(p.model.dtype)), p, reduction)


class WeightedMSE(nn.Module):
    """Module form of :func:`weighted_mse`."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        check_reduction(reduction)
        self.reduction = reduction

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None) -> Tensor:
        return weighted_mse(model, observed, mask, weights, self.reduction)


class Huber(nn.Module):
    """Module form of :func:`huber`."""

    def __init__(self, delta: float = 1.0, reduction: str = "mean") -> None:
        super().__init__()
        check_reduction(reduction)
        check_positive("delta", delta)
        self.delta, self.reduction = delta, reduction

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None) -> Tensor:
        return huber(model, observed, mask, weights, self.reduction, self.delta)


class LogIntensityMSE(nn.Module):
    """Module form of :func:`log_intensity_mse`."""

    def __init__(self, offset: float = 1.0, reduction: str = "mean") -> None:
        super().__init__()
        check_reduction(reduction)
        check_positive("offset", offset)
        self.offset, self.reduction = offset, reduction

    def forward(self, model: Tensor, observed: Tensor, mask: Tensor | None = None,
                weights: Tensor | float | None = None) -> Tensor:
        return log_intensity_mse(model, observed, mask, weights, self.reduction, self.offset)
