"""Look up an image loss module by short name: one registry, one meaning per name, everywhere
(:func:`get_loss`, ``nbtorch-refine --loss``, the sweeps; the refinement evaluates the same losses
through their check-free kernels, :data:`losses.kernels.PIXEL_TERMS`).

``get_loss(name, **kw)`` builds the :mod:`torch.nn` module for ``name`` with the
keyword options ``kw`` (passed to its constructor, e.g. ``reduction``,
``delta``, ``offset``, ``readout_sigma``, ``full``, ``dim``):

==========  ===================================================
name        module
==========  ===================================================
poisson     :class:`~losses.likelihood.PoissonDeviance` (the half deviance; the refinement's default)
poisson_nll :class:`~losses.likelihood.PoissonNLL`
gaussian    :class:`~losses.likelihood.GaussianNLL`
mse         :class:`~losses.regression.WeightedMSE`
huber       :class:`~losses.regression.Huber`
log         :class:`~losses.regression.LogIntensityMSE`
ncc         :class:`~losses.correlation.NCCLoss`
==========  ===================================================

Every module is called as ``loss(model, observed, mask=None, weights=None)``
(``GaussianNLL`` also takes ``variance=``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from losses.correlation import NCCLoss
from losses.likelihood import GaussianNLL, PoissonDeviance, PoissonNLL
from losses.regression import Huber, LogIntensityMSE, WeightedMSE
from nbtorch.errors import InputError

__all__ = ["LOSSES", "get_loss"]

LOSSES: dict[str, type[nn.Module]] = {
    "poisson": PoissonDeviance,
    "poisson_nll": PoissonNLL,
    "gaussian": GaussianNLL,
    "mse": WeightedMSE,
    "huber": Huber,
    "log": LogIntensityMSE,
    "ncc": NCCLoss,
}


def get_loss(name: str, **kw: Any) -> nn.Module:
    """The loss module registered as ``name``, constructed with ``**kw``."""
    try:
        cls = LOSSES[name]
    except (KeyError, TypeError):
        raise InputError(f"name: unknown loss {name!r}; valid names: {', '.join(LOSSES)}") from None
    try:
        return cls(**kw)
    except TypeError as err:  # unexpected keyword for this loss
        raise InputError(f"kw: {err}") from None
