"""Which pixels a refinement fits: rectangle, resolution shell, spot windows and a random subsample.

A measured image can hold 6 million pixels; simulating all of them at every
step is what makes refinement slow, and most of them are background.  The
fitted pixels are the AND of:

* the image mask (:class:`~refine.inputs.images.MeasuredImage`: gaps, bad, saturated pixels);
* a rectangle ``roi = (x0, x1, y0, y1)`` (inclusive fast/slow pixel bounds; the simulator
  then only covers that rectangle);
* a resolution shell ``dmin <= d <= dmax`` (Å), with ``d = lambda / (2 sin theta)`` at each
  pixel centre for the starting geometry (:func:`resolution_map`);
* optionally windows around spots (:func:`refine.inputs.spots.window_mask`) OR a random fraction of
  the other pixels (so the background, and model spots where nothing was observed, still count);
* otherwise a random ``subsample`` fraction of the pixels.

:meth:`nbtorch.Simulator.restricted` turns the final mask into a simulator that computes only
those pixels, so the pixels left out are not computed at all (they are 0 in its images)
rather than computed and ignored.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch

from nbtorch.errors import InputError
from nbtorch.parameters import PARAMETER_NAMES

__all__ = ["roi_mask", "resolution_map", "resolution_mask", "subsample_mask", "check_roi"]


def check_roi(roi: Sequence[int], shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """Validate ``(x0, x1, y0, y1)`` (inclusive) against the image ``shape`` (slow, fast)."""
    if len(roi) != 4:
        raise InputError(f"--roi: expected 4 integers x0 x1 y0 y1, got {len(roi)}")
    x0, x1, y0, y1 = (int(v) for v in roi)
    ny, nx = shape
    if not (0 <= x0 <= x1 < nx and 0 <= y0 <= y1 < ny):
        raise InputError(f"--roi {x0} {x1} {y0} {y1}: must satisfy 0 <= x0 <= x1 < {nx} and 0 <= y0 <= y1 < {ny} "
                         "(inclusive fast and slow pixel bounds)")
    return x0, x1, y0, y1


def roi_mask(shape: tuple[int, int], roi: Sequence[int]) -> np.ndarray:
    """Bool (slow, fast): True inside the inclusive rectangle ``roi``."""
    x0, x1, y0, y1 = check_roi(roi, shape)
    out = np.zeros(shape, dtype=bool)
    out[y0:y1 + 1, x0:x1 + 1] = True
    return out


def resolution_map(sim, roi: Sequence[int] | None = None, values: Mapping[str, float] | None = None) -> np.ndarray:
    """Resolution ``d`` (Å) at every pixel centre of the starting geometry, (slow, fast) (inf at the direct beam).

    Only the rectangle ``roi`` is computed (NaN outside) when given; ``values``: canonical parameters to use instead
    of the simulator's (e.g. the refined ones; other names are ignored).  A multi-panel detector: each panel's
    block of the stacked image from its own geometry (per-panel names of ``values`` used).
    """
    layout = sim.panel_layout
    names = set(PARAMETER_NAMES + (layout.names() if layout is not None else ()))
    overrides = {n: float(v) for n, v in (values or {}).items() if n in names}
    ny, nx = sim.shape
    x0, x1, y0, y1 = roi if roi is not None else (0, nx - 1, 0, ny - 1)
    out = np.full((ny, nx), np.nan)
    blocks = [(None, 0, ny, sim.setup.pixel_m)] if layout is None else [
        (i, i * layout.rows, (i + 1) * layout.rows, p.detector.pixel_m) for i, p in enumerate(layout.panels)]
    with torch.no_grad():
        p = sim.parameters_dict(**overrides)
        lam = float(p["wavelength"])
        for panel, r0, r1, px in blocks:
            a, b = max(y0, r0), min(y1, r1 - 1)
            if a > b:
                continue
            g = sim.geometry(p, panel=panel)
            frame = [getattr(g, k).double().cpu().numpy() for k in ("pix0", "fdet", "sdet", "beam")]
            out[a:b + 1, x0:x1 + 1] = _d_of_pixels(*frame, lam, (np.arange(x0, x1 + 1) + 0.5) * px,
                                                   (np.arange(a - r0, b - r0 + 1) + 0.5) * px)
    return out


def _d_of_pixels(pix0, f, s, b, lam: float, fi: np.ndarray, sj: np.ndarray) -> np.ndarray:
    """``d`` (Å) at the pixel centres ``pix0 + fi f + sj s`` (m) of one flat panel, (len(sj), len(fi))."""
    b = b / np.linalg.norm(b)
    # r = pix0 + fi f + sj s; cos 2theta = r.b / |r|, computed component by component to save memory
    rb = float(pix0 @ b) + fi[None, :] * float(f @ b) + sj[:, None] * float(s @ b)
    r2 = np.zeros((len(sj), len(fi)))
    for k in range(3):
        r2 += (pix0[k] + fi[None, :] * f[k] + sj[:, None] * s[k]) ** 2
    cos2t = np.clip(rb / np.sqrt(r2), -1.0, 1.0)
    sin_t = np.sqrt((1.0 - cos2t) / 2.0)
    with np.errstate(divide="ignore"):
        return np.where(sin_t > 0, lam / (2.0 * np.maximum(sin_t, 1e-300)), math.inf)


def resolution_mask(sim, dmin: float | None = None, dmax: float | None = None,
                    roi: Sequence[int] | None = None) -> np.ndarray:
    """Bool (slow, fast): True where ``dmin <= d <= dmax`` (Å; None = no limit)."""
    if dmin is not None and not dmin > 0:
        raise InputError(f"--dmin: must be > 0 (Å), got {dmin!r}")
    if dmax is not None and not dmax > 0:
        raise InputError(f"--dmax: must be > 0 (Å), got {dmax!r}")
    if dmin is not None and dmax is not None and not dmin < dmax:
        raise InputError(f"--dmin {dmin:g} must be smaller than --dmax {dmax:g} (both Å)")
    d = resolution_map(sim, roi)
    keep = np.isfinite(d) | np.isinf(d)
    with np.errstate(invalid="ignore"):
        if dmin is not None:
            keep &= d >= dmin
        if dmax is not None:
            keep &= d <= dmax
    return keep


def subsample_mask(mask: np.ndarray, fraction: float, seed: int = 0) -> np.ndarray:
    """A random ``fraction`` (0 < f <= 1) of the True pixels of ``mask`` (seeded, reproducible)."""
    if not 0 < fraction <= 1:
        raise InputError(f"--subsample: fraction must be in (0, 1], got {fraction!r}")
    mask = np.asarray(mask, dtype=bool)
    if fraction >= 1:
        return mask.copy()
    rng = np.random.default_rng(seed)
    return mask & (rng.random(mask.shape) < fraction)


