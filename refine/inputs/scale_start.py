"""The starting scale and background of a refinement of a measured image: a Poisson fit of the starting model.

A measured image's scale is unknown by orders of magnitude (``-default_F``, fluence, exposure).
:func:`fit_scale_background` gives the Poisson maximum-likelihood ``scale`` and ``background`` of the starting
model on the fitted pixels, or refuses a start that cannot be right (one line saying why);
:func:`refine.inputs.pixels.starting_scale_background` calls it for the names a run's start does not hold.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from nbtorch import eager
from nbtorch.errors import InputError
from nbtorch.parameters import PARAMETER_NAMES

__all__ = ["fit_scale_background", "MIN_BRAGG_FRACTION"]


#: smallest share of the fitted counts the starting model's Bragg part may explain (below: a collapsed scale)
MIN_BRAGG_FRACTION = 1e-9

_START_HINT = ("give the start yourself (--start scale=...,background=...) or check the starting model's orientation "
               "(-mat, --start misset_*), cell, beam centre and distance, or fit more pixels (--subsample, --roi, "
               "--spot-window)")


def fit_scale_background(sim, values: dict, observed, mask) -> tuple[float, float]:
    """Starting ``scale`` and ``background`` for ``model = scale * simulator + background``: the Poisson
    maximum-likelihood pair for the starting model on the ``mask`` pixels (one eager simulation).

    A measured image's scale is unknown by orders of magnitude (``-default_F``, fluence, exposure), and
    a start far off makes the first steps of a refinement move the geometry to absorb it.

    A start that cannot be right is refused rather than handed to the optimiser, where every derivative
    would be ~0 and the run would stop at once (``Status.NO_STEP``):

    * no fitted pixel has a finite, non-negative count;
    * the starting model is 0 (or not finite) on every fitted pixel: none of its spots is fitted;
    * the observed counts are not higher where the model has its spots than on average (the
      model-weighted mean count is at most the plain mean): the likelihood's best scale is 0, the
      model's spots miss the observed ones;
    * the fitted scale is not a positive normal number, or the model's Bragg part explains less than
      :data:`MIN_BRAGG_FRACTION` of the fitted counts (a scale that collapsed towards 0).

    Arguments:
        sim: the simulator; ``values``: canonical parameters (and ``orient_x/y/z``) of the start.
        observed: (slow, fast) counts; ``mask``: (slow, fast) bool, True = pixel fitted.

    Raises:
        InputError: one line saying which of the above happened and what to do.
    """

    x0, x1, y0, y1 = sim.setup.roi
    overrides = {n: torch.tensor(float(values[n]), dtype=torch.float64) for n in PARAMETER_NAMES if n in values}
    with torch.no_grad(), eager():
        img, _ = sim.render(**overrides)
    m_roi = np.asarray(mask, dtype=bool)[y0:y1 + 1, x0:x1 + 1]
    model = img.detach().cpu().double().numpy()[m_roi]
    obs = np.asarray(observed, dtype=np.float64)[y0:y1 + 1, x0:x1 + 1][m_roi]
    ok = np.isfinite(obs) & (obs >= 0)
    model, obs = model[ok], obs[ok]
    n = int(model.size)
    if n == 0:
        raise InputError("starting scale: no fitted pixel has a usable count (finite, >= 0); check --mask, --roi, "
                         "--dmin/--dmax and --subsample")
    model = np.where(np.isfinite(model), model, 0.0)
    if not model.max() > 0:
        raise InputError(f"starting scale: the starting model is 0 on all {n} fitted pixels (none of its spots is "
                         f"fitted), so no scale can be fitted; {_START_HINT}")
    mean_obs = float(obs.mean())
    mean_at_spots = float(np.sum(model * obs) / np.sum(model))
    if not mean_at_spots > mean_obs:
        raise InputError(f"starting scale: the observed counts are not higher where the starting model has its spots "
                         f"({mean_at_spots:.4g} vs {mean_obs:.4g} on average over {n} fitted pixels): its spots miss "
                         f"the observed ones and the best scale is 0; {_START_HINT}")
    # least squares for a start, then the Poisson fixed point s <- s sum(w m)/sum(m), b <- b mean(w), w = k/mu
    coef = np.linalg.lstsq(np.c_[model, np.ones_like(model)], obs, rcond=None)[0]
    s = max(float(coef[0]), 1e-6 * max(mean_obs, 1.0) / max(float(model.mean()), 1e-300))
    b = max(float(coef[1]), 1e-3)
    for _ in range(200):
        mu = s * model + b
        w = obs / mu
        s_new, b_new = s * float(np.sum(w * model) / np.sum(model)), b * float(np.mean(w))
        done = abs(s_new - s) <= 1e-10 * s and abs(b_new - b) <= 1e-10 * b
        s, b = max(s_new, 1e-300), max(b_new, 1e-6)
        if done:
            break
    bragg = s * float(np.sum(model))
    share = bragg / (bragg + b * n) if math.isfinite(bragg) and bragg + b * n > 0 else math.nan
    if not (math.isfinite(s) and s >= sys.float_info.min and math.isfinite(b)) or not share >= MIN_BRAGG_FRACTION:
        raise InputError(f"starting scale: the Poisson fit of the starting model gives no usable scale (scale {s:.4g}, "
                         f"its spots explain "
                         f"{share:.3g} of the counts on {n} fitted pixels); {_START_HINT}")
    return s, b
