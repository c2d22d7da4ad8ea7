"""The noise floor of the spot offsets: how far shot noise alone moves a spot finder's centroids.

The spot report (:func:`refine.inputs.spots.spot_offsets`) compares observed centroids, measured by a spot
finder on a noisy image, with the refined model's centroids.  A perfect model would not reach 0: the
observed centroids carry the image's Poisson noise.  :func:`spot_floor` measures that floor on the
refined model itself:

1. the model the loss sees, ``scale * Bragg + background [+ background_x * dx + background_y * dy]``
   (photons per pixel), on the windows around the matched spots that the spot report already rendered
   (:attr:`refine.inputs.spots.SpotOffsets.bragg`: nothing is simulated again);
2. ``realisations`` Poisson draws of it (``numpy.random.default_rng(seed)``: the same draws every run);
3. :func:`refine.inputs.spots.find_spots`, with its defaults, on the noise-free model and on each draw; per spot the
   component nearest the model's centroid (noise-free) or nearest the noise-free one (each draw), within
   ``radius`` pixels;
4. the floor: the rms of (noisy - noise-free) centroid over every (spot, draw) pair found.

The centroids are those of :func:`refine.inputs.spots.find_spots`, the finder ``--spots find`` measures the
observed spots with, so with ``find`` the floor and the offsets come from the same procedure.  A spot
list from another finder (the thaumatin lists: a median-filter background) was measured by a different
procedure; the floor then says how well *this* finder locates the model's spots in its shot noise.

:attr:`SpotFloor.procedure_rms_px` is the other part a perfect model would keep: the rms of the
finder's centroid of the noise-free model against the model centroid the offsets use (the peak's
5 x 5 box, :func:`refine.inputs.spots.model_centroids`), the two procedures' difference on a noise-free image.

Cost: the windows are copied side by side into one mosaic (separated by masked strips as wide as the
finder's background box, so no window sees another), and the finder runs once per image on it: well
under a second for the 491 spots of the thaumatin still.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from refine.quality.fit_quality import background_image
from refine.inputs.spots import SpotOffsets, find_spots

__all__ = ["SpotFloor", "centroid_floor", "spot_floor", "DEFAULT_REALISATIONS"]

log = logging.getLogger(__name__)

#: Poisson realisations of the refined model (the floor's rms over 5 x n spots is good to a few %)
DEFAULT_REALISATIONS = 5
#: the finder's ``background_box`` (:func:`refine.inputs.spots.find_spots`): masked strips this wide keep the windows apart
_GAP = 7


@dataclass(frozen=True)
class SpotFloor:
    """The centroid noise floor (:func:`centroid_floor`).

    Attributes:
        rms_px: rms (px) of (noisy - noise-free) finder centroid over the (spot, realisation) pairs found.
        procedure_rms_px: rms (px) of the noise-free finder centroid against the reference (model) centroid.
        spots: spots whose model spot the finder finds in the noise-free model (the floor is over these).
        found: fraction of the ``spots x realisations`` pairs in which the finder found the spot again.
        realisations, seed: the Poisson draws.
        per_spot: (n,) rms (px) of each spot over its realisations (NaN: not found).
        finder_rms_px: rms (px) of the noise-free finder centroid against the *observed* centroid: the spot offsets
            with the model's spots located as the finder locates the observed ones (like for like; the spot
            report's own offsets use the peak's 5 x 5 box, :attr:`procedure_rms_px` apart from this), over the
            ``spots`` found.
    """

    rms_px: float
    procedure_rms_px: float
    spots: int
    found: float
    realisations: int
    seed: int
    per_spot: np.ndarray = field(repr=False, compare=False)
    finder_rms_px: float = math.nan

    def to_dict(self) -> dict[str, float | int]:
        """The fields of the spot report in ``result.json`` (``spots.rms_px_floor`` ...)."""
        return {"rms_px_floor": self.rms_px, "rms_px_procedure": self.procedure_rms_px, "floor_spots": self.spots,
                "floor_found": self.found, "floor_realisations": self.realisations, "floor_seed": self.seed,
                "rms_px_finder": self.finder_rms_px}


@dataclass(frozen=True)
class _Mosaic:
    """Square windows of an image side by side, ``_GAP`` masked pixels apart."""

    image: np.ndarray
    usable: np.ndarray
    corner: np.ndarray  # (n, 2) image x, y of each window's pixel (0, 0)
    offset: np.ndarray  # (n, 2) mosaic x, y of each window's pixel (0, 0)
    stride: int
    columns: int

    def to_image(self, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window index (m,) and image x, y (m, 2) of centroids (m, 2) measured on the mosaic."""
        col = np.floor((found[:, 0] - _GAP) / self.stride).astype(int)
        row = np.floor((found[:, 1] - _GAP) / self.stride).astype(int)
        k = row * self.columns + col
        return k, found - self.offset[k] + self.corner[k]


def _mosaic(image: np.ndarray, usable: np.ndarray, centres: np.ndarray, half: int) -> _Mosaic:
    """The ``(2 half + 1)^2`` windows of ``image`` around the pixels of ``centres`` (x, y), side by side;
    pixels off the image or not ``usable`` are masked."""
    n, size = len(centres), 2 * half + 1
    stride = size + _GAP
    columns = max(int(math.ceil(math.sqrt(n))), 1)
    rows = max(int(math.ceil(n / columns)), 1)
    out = np.zeros((rows * stride + _GAP, columns * stride + _GAP))
    mask = np.zeros(out.shape, dtype=bool)
    corner = np.floor(centres).astype(int) - half
    k = np.arange(n)
    offset = np.stack([_GAP + (k % columns) * stride, _GAP + (k // columns) * stride], axis=1)
    ny, nx = image.shape
    for (x0, y0), (ox, oy) in zip(corner, offset):
        xa, xb, ya, yb = max(x0, 0), min(x0 + size, nx), max(y0, 0), min(y0 + size, ny)
        if xa < xb and ya < yb:
            dst = np.s_[oy + ya - y0:oy + yb - y0, ox + xa - x0:ox + xb - x0]
            out[dst], mask[dst] = image[ya:yb, xa:xb], usable[ya:yb, xa:xb]
    return _Mosaic(image=out, usable=mask, corner=corner, offset=offset, stride=stride, columns=columns)


def _nearest(mosaic: _Mosaic, image: np.ndarray, reference: np.ndarray, radius: float) -> np.ndarray:
    """(n, 2): per window, the finder's centroid on ``image`` (a mosaic) nearest the window's
    ``reference`` within ``radius`` px (NaN: none, or no reference)."""
    out = np.full(reference.shape, np.nan)
    found = find_spots(image, mosaic.usable)
    if not len(found):
        return out
    k, xy = mosaic.to_image(found)
    dist = np.hypot(*(xy - reference[k]).T)
    keep = dist <= radius  # False for NaN references
    k, xy, dist = k[keep], xy[keep], dist[keep]
    order = np.lexsort((dist, k))  # by window, nearest first
    k, xy = k[order], xy[order]
    first = np.ones(len(k), dtype=bool)
    first[1:] = k[1:] != k[:-1]
    out[k[first]] = xy[first]
    return out


def centroid_floor(expected: np.ndarray, usable: np.ndarray | None, spots: np.ndarray, reference: np.ndarray, *,
                   half: int, realisations: int = DEFAULT_REALISATIONS, seed: int = 0,
                   radius: float = 3.0) -> SpotFloor:
    """The :class:`SpotFloor` of the model ``expected`` (photons per pixel) around ``spots``.

    Arguments:
        expected: (slow, fast) noise-free model counts, valid within ``half`` pixels of each spot.
        usable: (slow, fast) bool, True = a pixel the finder may use (the image's mask; None = all).
        spots: (n, 2) x, y of the observed spots: the windows are centred on their pixels.
        reference: (n, 2) the model's centroid of each spot (NaN = none: left out).
        half: half-width of the windows (px); ``realisations``, ``seed``: the Poisson draws.
        radius: a centroid farther than this (px) from its reference is another spot, or none.
    """
    if realisations < 1:
        raise ValueError(f"realisations: must be >= 1, got {realisations}")
    spots = np.asarray(spots, dtype=np.float64).reshape(-1, 2)
    reference = np.asarray(reference, dtype=np.float64).reshape(-1, 2)
    expected = np.clip(np.asarray(expected, dtype=np.float64), 0.0, None)
    usable = np.ones(expected.shape, dtype=bool) if usable is None else np.asarray(usable, dtype=bool)
    if not len(spots):
        return SpotFloor(math.nan, math.nan, 0, math.nan, realisations, seed, np.zeros(0))
    mosaic = _mosaic(expected, usable, spots, half)
    clean = _nearest(mosaic, mosaic.image, reference, radius)
    have = np.isfinite(clean).all(axis=1)
    rng = np.random.default_rng(seed)
    sq = np.zeros((realisations, len(spots)))
    hit = np.zeros((realisations, len(spots)), dtype=bool)
    for r in range(realisations):
        noisy = rng.poisson(np.where(mosaic.usable, mosaic.image, 0.0)).astype(np.float64)
        d = _nearest(mosaic, noisy, clean, radius) - clean
        hit[r] = np.isfinite(d).all(axis=1)
        sq[r] = np.where(hit[r], (np.nan_to_num(d) ** 2).sum(axis=1), 0.0)
    n_hit = hit.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_spot = np.where(n_hit > 0, np.sqrt(sq.sum(axis=0) / n_hit), np.nan)
    rms = float(np.sqrt(sq.sum() / hit.sum())) if hit.any() else math.nan
    proc = clean[have] - reference[have]
    procedure = float(np.sqrt(np.mean((proc ** 2).sum(axis=1)))) if have.any() else math.nan
    like = clean[have] - spots[have]
    finder = float(np.sqrt(np.mean((like ** 2).sum(axis=1)))) if have.any() else math.nan
    found = float(hit[:, have].mean()) if have.any() else math.nan
    return SpotFloor(rms_px=rms, procedure_rms_px=procedure, spots=int(have.sum()), found=found,
                     realisations=realisations, seed=seed, per_spot=per_spot, finder_rms_px=finder)


def spot_floor(offsets: SpotOffsets, params: Mapping[str, float], mask: np.ndarray | None = None, *,
               realisations: int = DEFAULT_REALISATIONS, seed: int = 0,
               background: np.ndarray | None = None) -> SpotFloor:
    """The centroid noise floor of the matched spots of ``offsets`` (:func:`refine.inputs.spots.spot_offsets` of the
    refined model, which keeps its rendered Bragg image) for the refined ``params`` (``scale``,
    ``background`` [, ``background_x``, ``background_y``]); ``mask``: the image's usable pixels; ``background``: the
    run's background image (photons; :class:`refine.fitting.background.BackgroundModel`) instead of the params'."""
    if offsets.bragg is None:
        raise ValueError("spot_floor: the offsets keep no rendered model (SpotOffsets.bragg is None)")
    t0 = time.monotonic()
    matched = offsets.matched
    if background is None:
        background = background_image(offsets.bragg.shape, dict(params))
    expected = float(params.get("scale", 1.0)) * offsets.bragg + background
    floor = centroid_floor(expected, mask, offsets.observed[matched], offsets.predicted[matched],
                           half=offsets.window, realisations=realisations, seed=seed)
    log.info("spot noise floor %.3g px over %d spots (%d Poisson realisations, seed %d), %.2f s", floor.rms_px,
             floor.spots, realisations, seed, time.monotonic() - t0)
    return floor
