"""How well the refined model explains the image, measured against its own shot noise.

An optimiser that stops because nothing changes any more has found *a*
minimum; whether it is *the* minimum the loss cannot say by itself.  For the
Poisson loss (the half deviance ``d(k, m) = m - k + k log(k / m)``,
:func:`refine.objective.poisson_deviance`) the data can: if the observed
counts ``k`` were Poisson draws from the model ``m``, each pixel's deviance
would have the expectation

    E[d] = sum_k  Pois(k; m) d(k, m)          (about 1/2 + 1/(12 m) for large m)

so the final loss divided by ``sum E[d]`` over the fitted pixels, the
**excess**, is about 1 for a model that explains the image to the noise
level (below 1 when part of the signal is noiseless, such as a detector
pedestal), and far above 1 when it does not: a false minimum (spots
predicted beside the observed ones), or a model that lacks something the
data have (the structure factors, when every reflection gets one
``-default_F``; diffuse scattering, a background that is not flat, ice
rings, detector artefacts).  The refinement reports the number and, above
:data:`EXCESS_WARNING`, says so in ``result.warnings`` instead of letting
"converged" stand alone.

Pure functions of tensors; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["expected_poisson_deviance", "FitQuality", "assess_poisson_fit", "EXCESS_WARNING"]

#: final loss / noise expectation above which a converged refinement gets a warning
EXCESS_WARNING = 10.0

_SUM_BELOW = 30.0  # below this mean the expectation is summed over k; above, the asymptotic series
_K_MAX = 120  # Pois(k > 120; m <= 30) < 1e-30
_CHUNK = 1 << 15


def expected_poisson_deviance(model: Tensor) -> Tensor:
    """``E[d(k, m)]`` for ``k ~ Poisson(m)``, elementwise (same shape and dtype as ``model``).

    ``m >= 30``: ``1/2 + 1/(12 m) + 1/(12 m^2)`` (the Lawley series of the deviance's mean;
    the next term is below 1e-5 there); ``m < 30``: the sum over ``k = 0..120``.
    ``m <= 0`` gives 0 (such pixels carry no information).
    """
    m = model.clamp(min=0.0)
    big = m >= _SUM_BELOW
    m_big = torch.where(big, m, torch.full_like(m, _SUM_BELOW))
    out = 0.5 + 1.0 / (12.0 * m_big) + 1.0 / (12.0 * m_big * m_big)
    small = (~big & (m > 0)).reshape(-1)
    flat = out.reshape(-1)  # a view of the fresh `out`: filled in place below
    idx = small.nonzero().reshape(-1)
    k = torch.arange(_K_MAX + 1, dtype=m.dtype, device=m.device)[:, None]
    lgk = torch.lgamma(k + 1.0)
    xlogx = torch.special.xlogy(k, k)
    for start in range(0, idx.numel(), _CHUNK):  # (K, chunk) at a time: bounded memory on 6M-pixel images
        sel = idx[start:start + _CHUNK]
        ms = m.reshape(-1)[sel][None, :]
        log_m = torch.log(ms)
        pmf = torch.exp(k * log_m - ms - lgk)
        flat[sel] = (pmf * (ms - k + xlogx - k * log_m)).sum(0)
    flat = torch.where(m.reshape(-1) > 0, flat, torch.zeros_like(flat))
    return flat.reshape(m.shape)


@dataclass(frozen=True)
class FitQuality:
    """The final Poisson loss against the noise the model itself predicts.

    Attributes:
        loss: the final loss (half deviance) over the fitted pixels.
        expected: its expectation if the observed image were Poisson noise on the model.
        excess: ``loss / expected`` (about 1 for a fit to the noise level).
        pixels: fitted pixels.
    """

    loss: float
    expected: float
    excess: float
    pixels: int

    @property
    def warning(self) -> str | None:
        """A one-line explanation when the fit is far from the noise level (None otherwise)."""
        if not (self.excess > EXCESS_WARNING):
            return None
        return (f"the final loss is {self.excess:.3g}x what shot noise on the refined model explains "
                f"({self.loss:.6g} vs {self.expected:.6g} over {self.pixels} pixels): either a false minimum "
                "(check the residual image for spots predicted beside the observed ones; restart from a "
                "better orientation or beam centre) or a model that lacks something the image has "
                "(structure factors: one -default_F for every reflection; diffuse scattering, a structured "
                "background, ice rings, artefacts not masked)")

    def to_dict(self) -> dict[str, float | int | None]:
        return {"loss": self.loss, "expected_loss": self.expected, "excess": self.excess, "pixels": self.pixels}


def assess_poisson_fit(loss: float, model: Tensor, weights: Tensor) -> FitQuality:
    """:class:`FitQuality` of a final half-deviance ``loss`` with unbinned ``model`` photons and ``weights``.

    ``model`` and ``weights`` have the same shape; pixels with weight 0 are not counted.
    """
    w = weights.to(model.dtype)
    expected = float((w * expected_poisson_deviance(model.detach())).sum())
    excess = loss / expected if expected > 0 else math.inf
    return FitQuality(loss=float(loss), expected=expected, excess=float(excess), pixels=int((w > 0).sum()))
