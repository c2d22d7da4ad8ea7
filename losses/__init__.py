"""Losses for fitting simulated diffraction images to observed ones.

Image losses compare a simulated ``model`` (expected photons per pixel) with
``observed`` counts of the same shape.  Each is a pure function plus a thin
:class:`torch.nn.Module` wrapper; all take ``mask`` (bool, True = use pixel),
``weights`` (broadcastable, >= 0) and ``reduction`` (``'mean'`` = weighted mean
over unmasked pixels, ``'sum'``, ``'none'``), and raise ``ValueError``
(:class:`nbtorch.errors.InputError`) with a one-line message for bad input.

* :func:`poisson_deviance` / :class:`PoissonDeviance` - half Poisson deviance (``"poisson"``).
* :func:`poisson_nll` / :class:`PoissonNLL` - Poisson negative log-likelihood (``"poisson_nll"``).
* :func:`gaussian_nll` / :class:`GaussianNLL` - Gaussian NLL, variance default ``model + readout_sigma^2``.
* :func:`weighted_mse` / :class:`WeightedMSE` - squared error.
* :func:`huber` / :class:`Huber` - Huber loss.
* :func:`log_intensity_mse` / :class:`LogIntensityMSE` - squared error of ``log(I + offset)``.
* :func:`normalized_cross_correlation` / :class:`NCCLoss` - ``1 - NCC``.
* :func:`get_loss` - module by name (``poisson poisson_nll gaussian mse huber log ncc``).

The functions and modules validate their inputs and call the check-free kernels of
:mod:`losses.kernels`, which compiled code and the refinement use directly.

Parameter priors: :func:`gaussian_restraint`, :class:`Restraint` and
:class:`Restraints` (``0.5 * ((value - target) / sigma)^2`` summed).
"""

from __future__ import annotations

from losses.correlation import NCCLoss, normalized_cross_correlation
from losses.likelihood import GaussianNLL, PoissonDeviance, PoissonNLL, gaussian_nll, poisson_deviance, poisson_nll
from losses.registry import LOSSES, get_loss
from losses.regression import Huber, LogIntensityMSE, WeightedMSE, huber, log_intensity_mse, weighted_mse
from losses.restraints import Restraint, Restraints, gaussian_restraint

__all__ = [
    "poisson_deviance",
    "poisson_nll",
    "gaussian_nll",
    "weighted_mse",
    "huber",
    "log_intensity_mse",
    "normalized_cross_correlation",
    "gaussian_restraint",
    "PoissonDeviance",
    "PoissonNLL",
    "GaussianNLL",
    "WeightedMSE",
    "Huber",
    "LogIntensityMSE",
    "NCCLoss",
    "Restraint",
    "Restraints",
    "LOSSES",
    "get_loss",
]
