"""Which images of a serial joint refinement do not fit: the stated rule (:class:`ScreeningRule`).

After a joint loop (:func:`refine.many.joint.refine_joint`), each image's final fit against shot noise is its
**excess** ``loss / expected loss`` (:func:`refine.quality.fit_quality.assess_poisson_fit`; 1 for a model that
explains the image up to Poisson noise).  An image is dropped, with the reason recorded, when

1. its model could not be evaluated (a NaN loss): ``"evaluation failed"``;
2. it fits far worse than the others: excess above ``median + n_mad x MAD`` *and* above ``ratio x median``
   (``MAD`` the median absolute deviation x 1.4826, the standard deviation of normal scatter; floored at
   ``mad_floor x median`` so that a set of near-identical fits does not drop an image for a trifle):
   ``"fit far worse than the others"``.  A failed start (a wrong indexing solution), another crystal form and
   an image without a lattice all end here: their spots cannot be placed;
3. its refined scale is below ``min_scale x`` the median scale (the model explains it by the background
   alone): ``"no diffraction"``.

The medians are over the images of the round, so the rule adapts to the data's own level of misfit; it needs the
Poisson loss's excess (other losses: the loss per fitted pixel stands in for it).  Defaults: ``n_mad = 6``,
``ratio = 1.5``, ``mad_floor = 0.05``, ``min_scale = 0.05``.  After the short first round of
:func:`refine.many.serial.refine_serial` the good images have not all converged (on 60 stills after 12 steps a
few good ones stood at 2-4.5 x the median excess, the bad ones at 38 x and more), so there the ratio is
``first_ratio = 10``: only gross misfits go, the others are judged on the converged fits of the next round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["ScreeningRule", "screen", "REASONS"]

REASONS = ("evaluation failed", "fit far worse than the others", "no diffraction")


@dataclass(frozen=True)
class ScreeningRule:
    """The thresholds of the module docstring's rule."""

    n_mad: float = 6.0
    ratio: float = 1.5
    mad_floor: float = 0.05
    min_scale: float = 0.05
    first_ratio: float = 10.0

    def first_round(self) -> "ScreeningRule":
        """The rule after the short first round (its fits not converged): only gross misfits (``first_ratio``)."""
        return ScreeningRule(self.n_mad, max(self.ratio, self.first_ratio), self.mad_floor, self.min_scale,
                             self.first_ratio)

    def describe(self) -> str:
        return (f"dropped: a NaN loss; excess > median + {self.n_mad:g} MAD and > {self.ratio:g} x median "
                f"(> {self.first_ratio:g} x after the short first round); scale < {self.min_scale:g} x median")


def screen(excess: Sequence[float], scale: Sequence[float], rule: ScreeningRule = ScreeningRule()
           ) -> dict[int, str]:
    """``{position: reason}`` of the images to drop (positions into ``excess``/``scale``, one per image)."""
    e = np.asarray(excess, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64)
    out: dict[int, str] = {}
    finite = np.isfinite(e)
    for i in np.flatnonzero(~finite):
        out[int(i)] = REASONS[0]
    if finite.sum() == 0:
        return out
    med = float(np.median(e[finite]))
    mad = max(1.4826 * float(np.median(np.abs(e[finite] - med))), rule.mad_floor * abs(med))
    limit = max(med + rule.n_mad * mad, rule.ratio * med)
    for i in np.flatnonzero(finite & (e > limit)):
        out[int(i)] = f"{REASONS[1]} (excess {e[i]:.3g} > {limit:.3g}; median {med:.3g})"
    ok = np.isfinite(s)
    med_s = float(np.median(s[ok])) if ok.any() else math.nan
    for i in np.flatnonzero(ok & (s < rule.min_scale * med_s)):
        out.setdefault(int(i), f"{REASONS[2]} (scale {s[i]:.3g} < {rule.min_scale:g} x median {med_s:.3g})")
    return out
