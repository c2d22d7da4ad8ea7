"""The pixel choice and the start of a refinement of a measured image, as one public API.

``nbtorch-refine``, the docs and the experiments all call these two functions::

    choice = choose_pixels(sim, image, mask, dmin_A=2.0, spots="find", spot_window_px=4, subsample=0.01)
    sim = choice.simulator(sim)                        # computes only the chosen pixels
    start = starting_scale_background(sim, image, choice.mask, start)
    result = refine(sim, image, mask=choice.mask, start=start, ...)

:func:`choose_pixels` combines, in this order (each an AND unless said):

1. ``mask`` (the image's usable pixels: gaps, bad and saturated pixels) and the model's region of
   interest (``-roi``);
2. the resolution shell ``dmin_A <= d <= dmax_A`` at the starting geometry
   (:func:`refine.inputs.selection.resolution_mask`);
3. spots (an ``(n, 2+)`` array of x fast, y slow positions in pixels, pixel centres at ``i + 0.5``, or
   ``"find"`` for :func:`refine.inputs.spots.find_spots` on the image): the spots outside the pixels chosen so
   far are dropped; with ``spot_window_px`` the fit keeps the square windows of that half-width around
   the spots OR a random ``subsample`` fraction of the other pixels (so background, and model spots
   where nothing was observed, still count; ``rest_ratio``: at most that many of them per window pixel);
4. otherwise a random ``subsample`` fraction (seeded by ``seed``: the same pixels every run).

:func:`starting_scale_background` gives the Poisson maximum-likelihood ``scale`` and ``background``
of the starting model on the chosen pixels, for the names ``start`` does not already hold: a measured
image's scale is unknown by orders of magnitude (``-default_F``, fluence, exposure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from nbtorch.errors import InputError
from refine.inputs.scale_start import fit_scale_background
from refine.inputs.selection import resolution_mask, roi_mask, subsample_mask
from refine.inputs.spots import find_spots, window_mask

__all__ = ["PixelChoice", "choose_pixels", "check_pixel_options", "model_values", "starting_scale_background"]


@dataclass(frozen=True)
class PixelChoice:
    """The pixels a refinement fits.

    Attributes:
        mask: (slow, fast) bool, True = fitted.
        spots: ``(n, 2+)`` the observed spots inside the fitted region (None without spots).
        windows: pixels in the spot windows (0 without them); rest_fraction: the fraction of the other pixels
            fitted with them (None without windows).
    """

    mask: np.ndarray
    spots: np.ndarray | None
    windows: int = 0
    rest_fraction: float | None = None

    @property
    def n_used(self) -> int:
        return int(self.mask.sum())

    @property
    def fraction(self) -> float:
        return self.n_used / self.mask.size

    def simulator(self, sim):
        """``sim`` restricted to the fitted pixels (:meth:`nbtorch.Simulator.restricted`; ``sim`` itself
        when every pixel is fitted): the pixels left out are not computed at all."""
        return sim.restricted(self.mask) if self.n_used < self.mask.size else sim


def _spots_inside(spots: np.ndarray, use: np.ndarray, roi, source: str) -> np.ndarray:
    """The spots whose pixel lies in ``roi`` and in ``use``; an error naming ``source`` if none does."""
    x0, x1, y0, y1 = roi
    sx, sy = np.floor(spots[:, 0]).astype(int), np.floor(spots[:, 1]).astype(int)
    inside = (sx >= x0) & (sx <= x1) & (sy >= y0) & (sy <= y1)
    inside &= use[np.clip(sy, 0, use.shape[0] - 1), np.clip(sx, 0, use.shape[1] - 1)]
    if not inside.any():
        raise InputError(f"{source}: no spot inside the fitted region")
    return spots[inside]


def check_pixel_options(subsample: float | None, spot_window_px: int | None, has_spots: bool) -> None:
    """The checks of :func:`choose_pixels`' options that need no image (the CLI runs them before reading)."""
    if subsample is not None and not 0 < subsample <= 1:
        raise InputError(f"--subsample: fraction must be in (0, 1], got {subsample:g}")
    if spot_window_px is not None and spot_window_px < 0:
        raise InputError(f"--spot-window: must be >= 0 pixels, got {spot_window_px}")
    if spot_window_px is not None and not has_spots:
        raise InputError("--spot-window needs --spots (a spot list or 'find')")


def choose_pixels(sim, observed, mask=None, *, dmin_A: float | None = None, dmax_A: float | None = None,
                  spots: np.ndarray | str | None = None, spot_window_px: int | None = None,
                  subsample: float | None = None, seed: int = 0, spots_source: str = "spots",
                  rest_ratio: float | None = None) -> PixelChoice:
    """The fitted pixels of ``observed`` (slow, fast) for the starting model ``sim`` (see the module).

    Arguments:
        mask: (slow, fast) bool, True = usable (default: every pixel).
        dmin_A, dmax_A: resolution limits (Å; None = none).
        spots: observed spot positions (x, y first) or ``"find"``; ``spot_window_px``: half-width of the
            windows around them (needs spots).
        subsample: fraction in (0, 1] of the pixels (with windows: of the pixels outside them).
        rest_ratio: with windows, the subsample of the other pixels lowered to hold at most this many pixels per
            window pixel (None: ``subsample`` as given).
        seed: of the subsample.  ``spots_source``: how errors name the spots (``--spots FILE`` in the CLI).

    Raises:
        InputError: no pixel left, no spot in the fitted region, bad limits or fraction.
    """
    observed = np.asarray(observed)
    use = np.ones(observed.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool).copy()
    if use.shape != observed.shape:
        raise InputError(f"mask: shape {use.shape} does not match the image {observed.shape} (slow, fast)")
    check_pixel_options(subsample, spot_window_px, spots is not None)
    roi = sim.setup.roi
    use &= roi_mask(observed.shape, roi)
    if dmin_A is not None or dmax_A is not None:
        use &= resolution_mask(sim, dmin_A, dmax_A, roi)
    chosen_spots, windows, rest_fraction = None, 0, None
    if spots is not None:
        found = find_spots(observed, use, roi=roi) if isinstance(spots, str) and spots == "find" else spots
        found = np.asarray(found, dtype=np.float64)
        found = found.reshape(len(found), -1) if found.size else np.zeros((0, 2))
        chosen_spots = _spots_inside(found, use, roi, spots_source)
        if spot_window_px is not None:
            win = use & window_mask(observed.shape, chosen_spots[:, :2], int(spot_window_px))
            windows, rest_fraction = int(win.sum()), _rest_fraction(subsample, rest_ratio, win, use)
            rest = subsample_mask(use & ~win, rest_fraction, seed) if rest_fraction else np.zeros_like(use)
            use = win | rest
    if subsample and spot_window_px is None:
        use = subsample_mask(use, subsample, seed)
    if not use.any():
        raise InputError("no pixel left to fit: the mask, --roi, --dmin/--dmax and --subsample exclude every pixel")
    return PixelChoice(mask=use, spots=chosen_spots, windows=windows, rest_fraction=rest_fraction or None)


def _rest_fraction(subsample: float | None, rest_ratio: float | None, windows: np.ndarray, use: np.ndarray) -> float:
    """The fraction of the usable pixels outside the ``windows`` that is fitted: ``subsample`` (0 without it), at
    most ``rest_ratio`` of them per window pixel."""
    if not subsample:
        return 0.0
    if rest_ratio is None:
        return float(subsample)
    rest = int((use & ~windows).sum())
    return float(min(subsample, rest_ratio * int(windows.sum()) / rest)) if rest else 0.0


def model_values(sim, start: Mapping[str, float] | None = None) -> dict[str, float]:
    """The simulator's parameters with the names of ``start`` that the simulator knows put over them."""
    values = {n: float(v) for n, v in sim.setup.params.items()}
    values.update({k: float(v) for k, v in (start or {}).items() if k in values})
    return values


def starting_scale_background(sim, observed, pixels: np.ndarray,
                              start: Mapping[str, float] | None = None) -> dict[str, float]:
    """``start`` completed with the Poisson fit of ``scale`` and ``background`` of the starting model
    (``sim``'s parameters with ``start`` over them) on the True ``pixels``; names already in ``start``
    are kept.  One eager simulation."""
    out = dict(start or {})
    if {"scale", "background"} <= set(out):
        return out
    scale, background = fit_scale_background(sim, model_values(sim, out), observed, pixels)
    out.setdefault("scale", scale)
    out.setdefault("background", background)
    return out
