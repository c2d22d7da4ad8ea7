"""Where a gradient check looks (:mod:`nbtorch.tools.gradcheck_report`): the Bragg spots of a cheap preview
(:func:`find_spots`), the square ROI holding the most of them (:func:`choose_roi`) and the ROI's signal, which lets a
check refuse a trivial image (:class:`Signal`, :func:`measure_signal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def find_spots(image: Tensor, rel: float = 0.05, background: float | None = None, factor: float = 5.0,
               interior: bool = True, window: int = 5) -> Tensor:
    """Boolean map of Bragg spots: maxima of their ``window`` x ``window`` neighbourhood (5: the
    subsidiary maxima next to a strong spot do not count) above ``rel`` x the image maximum and
    above ``factor`` x ``background`` (default: the image's lower quartile).

    ``interior``: ignore the outermost rows/columns (a maximum there may be a slope).
    """
    img = image.detach().to(torch.float64)
    if background is None:
        background = float(torch.quantile(img.reshape(-1), 0.25))
    pooled = torch.nn.functional.max_pool2d(img[None, None], window, 1, window // 2)[0, 0]
    peak = float(img.max())
    spots = (img == pooled) & (img > rel * peak) & (img > factor * background) & (img > 0)
    if interior:
        spots[0, :] = spots[-1, :] = False
        spots[:, 0] = spots[:, -1] = False
    return spots


def _window_sums(a: Tensor, k: int) -> Tensor:
    """``out[j, i] = a[j:j+k, i:i+k].sum()`` for every k x k window."""
    c = torch.nn.functional.pad(a.cumsum(0).cumsum(1), (1, 0, 1, 0))
    return c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]


def choose_roi(preview: Tensor, size: int, center: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """``(x0, x1, y0, y1)`` inclusive: the ``size`` square of ``preview`` holding the most spots
    at least one pixel inside its edge (ties: the larger summed intensity), or the square
    centred on ``center = (fast, slow)``."""
    ns, nf = preview.shape
    size = max(3, min(size, ns, nf))
    if center is not None:
        x0 = min(max(center[0] - size // 2, 0), nf - size)
        y0 = min(max(center[1] - size // 2, 0), ns - size)
        return (x0, x0 + size - 1, y0, y0 + size - 1)
    img = preview.detach().to(torch.float64)
    spots = find_spots(img, interior=False).to(torch.float64)
    counts = _window_sums(spots, size - 2)[1:ns - size + 2, 1:nf - size + 2]
    total = _window_sums(img, size)
    score = counts * (float(total.max()) + 1.0) + total
    j, i = np.unravel_index(int(torch.argmax(score)), tuple(score.shape))
    return (int(i), int(i) + size - 1, int(j), int(j) + size - 1)


@dataclass(frozen=True)
class Signal:
    """What the ROI image holds: spots above background, peak and background (photons)."""

    roi: tuple[int, int, int, int]
    n_spots: int
    peak: float
    background: float
    total: float

    def __str__(self) -> str:
        x0, x1, y0, y1 = self.roi
        return (f"ROI x {x0}..{x1} y {y0}..{y1} ({x1 - x0 + 1}x{y1 - y0 + 1} px): {self.n_spots} spots, "
                f"peak {self.peak:.4g}, background {self.background:.3g}, sum {self.total:.4g} photons")

    @property
    def short(self) -> str:
        return f"{self.n_spots} spots, peak {self.peak:.3g}"


def measure_signal(image: Tensor, roi: tuple[int, int, int, int]) -> Signal:
    img = image.detach().to(torch.float64)
    background = float(torch.quantile(img.reshape(-1), 0.25))
    spots = find_spots(img, background=background)
    return Signal(roi=roi, n_spots=int(spots.sum()), peak=float(img.max()), background=background,
                  total=float(img.sum()))
