"""How well the refined model explains the image, measured against its own shot noise.

An optimiser that stops because nothing changes any more has found *a*
minimum; whether it is *the* minimum the loss cannot say by itself.  For the
Poisson loss (the half deviance ``d(k, m) = m - k + k log(k / m)``,
:func:`refine.fitting.objective.poisson_deviance`) the data can: if the observed
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

A fit can also be at the noise level and still say little: when the refined
model has signal on only a few fitted pixels, a handful of spots decides every
parameter.  :func:`signal_support` counts the fitted pixels whose predicted
Bragg signal stands out of the background's shot noise (at least
:data:`SIGNAL_SIGMA` standard deviations, ``sqrt(background)``) and the spots
among them (local maxima of the Bragg part, so spots whose tails touch count
one each), and warns when there are fewer
than :data:`MIN_SPOTS_PER_PARAMETER` spots per refined parameter.  The
threshold: a spot's position gives two numbers (its x and y centroid) and its
intensity a third, so one spot per parameter would leave the fit exactly
determined, with any error in one spot (a misfit, a mis-indexed or partial
reflection, a detector artefact) passing straight into the parameters; five per
parameter is the usual rule of thumb of least squares for an over-determined,
outlier-tolerant fit.  The counts are in ``result.fit`` (``signal_pixels``,
``signal_spots``, ``parameters``, ``spots_per_parameter``) and the warning in
``result.fit["support_warning"]``, ``result.warnings`` and the log.

Pure functions of tensors and arrays; no I/O.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["expected_poisson_deviance", "FitQuality", "assess_poisson_fit", "EXCESS_WARNING", "SignalSupport",
           "signal_support", "background_image", "MIN_SPOTS_PER_PARAMETER", "SIGNAL_SIGMA"]

log = logging.getLogger(__name__)

#: final loss / noise expectation above which a converged refinement gets a warning
EXCESS_WARNING = 10.0
#: fewer spots with signal per refined parameter than this gives a warning (module docstring: why 5)
MIN_SPOTS_PER_PARAMETER = 5
#: a fitted pixel carries signal when the model's Bragg part is at least this many sqrt(background)
SIGNAL_SIGMA = 3.0

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
        amplitudes_refined: the structure factors were refined (the warning then does not blame one F for all).
    """

    loss: float
    expected: float
    excess: float
    pixels: int
    amplitudes_refined: bool = False

    @property
    def warning(self) -> str | None:
        """A one-line explanation when the fit is far from the noise level (None otherwise)."""
        if not (self.excess > EXCESS_WARNING):
            return None
        lacking = ("the spot shapes (mosaic domains, crystal shape, beam divergence and bandwidth)"
                   if self.amplitudes_refined else "structure factors: one -default_F for every reflection")
        return (f"the final loss is {self.excess:.3g}x what shot noise on the refined model explains "
                f"({self.loss:.6g} vs {self.expected:.6g} over {self.pixels} pixels): either a false minimum "
                "(check the residual image for spots predicted beside the observed ones; restart from a "
                f"better orientation or beam centre) or a model that lacks something the image has ({lacking}; "
                "diffuse scattering, a structured background, ice rings, artefacts not masked)")

    def to_dict(self) -> dict[str, float | int | None]:
        return {"loss": self.loss, "expected_loss": self.expected, "excess": self.excess, "pixels": self.pixels}


def assess_poisson_fit(loss: float, model: Tensor, weights: Tensor) -> FitQuality:
    """:class:`FitQuality` of a final half-deviance ``loss`` with unbinned ``model`` photons and ``weights``.

    ``model`` and ``weights`` have the same shape; pixels with weight 0 are not counted.
    """
    if weights.shape != model.shape:
        raise ValueError(f"weights: shape {tuple(weights.shape)} differs from the model's {tuple(model.shape)}")
    w = weights.to(model.dtype).reshape(-1)
    used = w > 0  # only the fitted pixels: a sparse fit's view is mostly unused (the tutorial: 82k of 1.44M)
    expected = float((w[used] * expected_poisson_deviance(model.detach().reshape(-1)[used])).sum())
    excess = loss / expected if expected > 0 else math.inf
    return FitQuality(loss=float(loss), expected=expected, excess=float(excess), pixels=int(used.sum()))


@dataclass(frozen=True)
class SignalSupport:
    """How many fitted pixels and spots carry the refined model's signal, against the parameters refined.

    Attributes:
        signal_pixels: fitted pixels whose Bragg part is at least :data:`SIGNAL_SIGMA` ``sqrt(background)``.
        spots: local maxima of the Bragg part among those pixels (one per spot, also where spots touch).
        parameters: refined parameters.
    """

    signal_pixels: int
    spots: int
    parameters: int

    @property
    def per_parameter(self) -> float:
        return self.spots / self.parameters if self.parameters else math.inf

    @property
    def warning(self) -> str | None:
        """One line when there are fewer than :data:`MIN_SPOTS_PER_PARAMETER` spots per refined parameter."""
        if not self.parameters or self.spots >= MIN_SPOTS_PER_PARAMETER * self.parameters:
            return None
        if self.spots == 0:
            return (f"no fitted pixel carries the model's signal ({SIGNAL_SIGMA:g} sqrt(background) above the "
                    f"background) for {self.parameters} refined parameters: the model's spots miss the fitted pixels "
                    "or its scale is ~0, so no spot determines the result; check the start (orientation, beam "
                    "centre, cell) and the fitted pixels")
        return (f"only {self.spots} spots ({self.signal_pixels} pixels) carry the model's signal on the fitted pixels "
                f"for {self.parameters} refined parameters (fewer than {MIN_SPOTS_PER_PARAMETER} per parameter): "
                "the result rests on a few spots; fit more of the image (--roi, --dmin, --subsample, --spot-window) "
                "or refine fewer parameters")

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {"signal_pixels": self.signal_pixels, "signal_spots": self.spots, "parameters": self.parameters,
                "spots_per_parameter": self.per_parameter, "support_warning": self.warning}


def background_image(shape: tuple[int, int], params: dict) -> np.ndarray:
    """The refined background (photons per pixel) on a (slow, fast) image: ``background [+ background_x * dx +
    background_y * dy]``, ``dx, dy`` the offsets from the image centre as in :mod:`refine.fitting.objective`."""
    ny, nx = int(shape[0]), int(shape[1])
    bg = np.full((ny, nx), float(params.get("background", 0.0)))
    bx, by = float(params.get("background_x", 0.0) or 0.0), float(params.get("background_y", 0.0) or 0.0)
    if bx:
        bg += bx * (np.arange(nx) - (nx - 1) / 2.0)[None, :]
    if by:
        bg += by * (np.arange(ny) - (ny - 1) / 2.0)[:, None]
    return bg


def signal_support(model: np.ndarray, background: np.ndarray | float, mask: np.ndarray,
                   parameters: int) -> SignalSupport:
    """:class:`SignalSupport` of a refined ``model`` image (photons, background included).

    Arguments:
        model: (slow, fast) model photons; ``background``: the background part (an image or a number).
        mask: (slow, fast) bool, True = fitted pixel; ``parameters``: how many were refined.
    """
    model = np.asarray(model, dtype=np.float64)
    bg = np.broadcast_to(np.asarray(background, dtype=np.float64), model.shape)
    bragg = np.where(np.isfinite(model - bg), model - bg, -np.inf)
    signal = np.asarray(mask, dtype=bool) & (bragg >= SIGNAL_SIGMA * np.sqrt(np.maximum(bg, 1.0)))
    n_pixels = int(signal.sum())
    # spots: local maxima (not below any of the 8 neighbours) of the Bragg part among the signal pixels, so
    # spots whose tails touch still count one each
    ny, nx = bragg.shape
    padded = np.pad(bragg, 1, constant_values=-np.inf)
    peak = signal.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            if dy or dx:
                peak &= bragg >= padded[1 + dy:1 + dy + ny, 1 + dx:1 + dx + nx]
    n_spots = int(peak.sum())
    support = SignalSupport(n_pixels, n_spots, int(parameters))
    if support.warning is not None:
        log.warning("%s", support.warning)
    return support
