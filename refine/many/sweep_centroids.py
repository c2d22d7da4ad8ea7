"""A rotation sweep's spots compared as DIALS measured them: each observed centroid against the model's centroid over
the whole shoebox, on every image of the run the reflection spans (docs/sweep-from-dials.md).

DIALS's ``xyzobs.px.value`` of a strong spot is the intensity-weighted centroid of its shoebox in three dimensions:
the fast and slow pixel over every frame the reflection lights (``bbox``, frames from the scan's start).  A 0.1 deg
image holds only a slice of a reflection that rocks through several frames, and the spot moves on the detector while
the reflection crosses the Ewald sphere (on the L-cysteine sweep 0.1-2 px per frame, most near the spindle): the
model's spot on the one image that holds ``z`` lies up to 0.4 px from the three-dimensional centroid of the same
model (0.21 px rms over the sweep's 17 spots, from analytic predictions), which is a difference of measurement, not
of the model.  :func:`box_sums` renders the model's Bragg image (photons, no scale or background: each image's scale
is a constant factor of its frame, applied here) within each spot's ``bbox`` on each image of the run whose frame
the box spans, and sums the intensity and its first moments; :func:`centroid_offsets` turns the sums of every image
into the model's centroids and their offsets from the observed ones.

Frames: image ``i`` of the run is frame ``f_i`` (the scan's image number less the scan's first, as DIALS counts:
its pixels are frame ``[f_i, f_i + 1)``); pixel centres at ``i + 0.5`` (x fast, y slow) as the ``.refl``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from refine.inputs.spots import render_pixels

__all__ = ["box_sums", "centroid_offsets", "MIN_FRACTION"]

#: a spot counts as matched (the model has a spot there) when the model's intensity in its shoebox over the run is at
#: least this fraction of the brightest spot's, as :func:`refine.inputs.spots.spot_offsets`'s peak threshold
MIN_FRACTION = 1e-3


def _box_mask(shape: tuple[int, int], boxes: np.ndarray) -> np.ndarray:
    """Bool (slow, fast): True inside every box ``(x0, x1, y0, y1, ...)`` (ends exclusive, clipped to the image)."""
    out = np.zeros(shape, dtype=bool)
    ny, nx = shape
    for x0, x1, y0, y1 in np.asarray(boxes, dtype=np.int64)[:, :4]:
        out[max(y0, 0):min(y1, ny), max(x0, 0):min(x1, nx)] = True
    return out


def box_sums(sim, values: Mapping[str, float], boxes: np.ndarray, frame: int) -> np.ndarray:
    """``(n, 3)``: for each box ``(x0, x1, y0, y1, z0, z1)`` (pixels and frames, ends exclusive) whose frames hold
    ``frame`` (this image's), the model's scaled Bragg intensity in it (photons) and its first moments in x and y
    (photons x px, pixel centres); zeros for the others.  One render of the union of the boxes on this image."""
    boxes = np.asarray(boxes, dtype=np.int64).reshape(-1, 6)
    out = np.zeros((len(boxes), 3))
    here = (boxes[:, 4] <= frame) & (frame < boxes[:, 5])
    if not here.any():
        return out
    model = render_pixels(sim, values, _box_mask(sim.shape, boxes[here])) * float(values.get("scale", 1.0))
    ny, nx = model.shape
    for k in np.nonzero(here)[0]:
        x0, x1, y0, y1 = (int(v) for v in boxes[k, :4])
        x0, x1, y0, y1 = max(x0, 0), min(x1, nx), max(y0, 0), min(y1, ny)
        w = np.clip(model[y0:y1, x0:x1], 0.0, None)
        gy, gx = np.mgrid[y0:y1, x0:x1]
        out[k] = (w.sum(), (w * (gx + 0.5)).sum(), (w * (gy + 0.5)).sum())
    return out


def centroid_offsets(sums: np.ndarray, observed_xy: np.ndarray) -> np.ndarray:
    """``(n, 2)`` model centroid minus observed ``(x, y)`` (px) from the summed :func:`box_sums` of every image; NaN
    where the model has (almost) nothing in the box (below :data:`MIN_FRACTION` of the brightest spot's sum)."""
    sums = np.asarray(sums, dtype=np.float64).reshape(-1, 3)
    total = sums[:, 0]
    peak = float(total.max()) if total.size else 0.0
    ok = (total > MIN_FRACTION * peak) & (total > 0)
    out = np.full((len(sums), 2), np.nan)
    out[ok] = sums[ok, 1:] / total[ok, None] - np.asarray(observed_xy, dtype=np.float64)[ok, :2]
    return out
