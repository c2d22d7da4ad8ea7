"""The background under the Bragg spots: a flat level, a smooth function of resolution, or a plane per spot window.

Image model (photons per pixel; :mod:`refine.fitting.objective`)::

    model = scale * simulated + B

``B`` by ``--background`` (``refine(background=...)``):

===================  ======================================================================================
kind                 ``B``
===================  ======================================================================================
``constant``         ``background`` (one level for the whole detector; the default)
``planar``           ``background + background_x (x - xc) + background_y (y - yc)``
``resolution[:K]``   a linear spline in ``s = 1/d`` (1/Å) through ``K`` knots (default :data:`DEFAULT_KNOTS`),
                     evenly spaced from the lowest to the highest ``s`` of the fitted pixels; the knot values
                     ``background_0 .. background_{K-1}`` (photons/pixel, positive) are refined
``planes``           in each spot window a plane ``a + b dx + c dy`` (``dx, dy`` from the spot's pixel) fitted
                     to the window's pixels farther than :data:`SPOT_CORE_PX` from every observed spot, then
                     held (diffBragg's per-shoebox background, not refined); ``background`` elsewhere
===================  ======================================================================================

Choices, and why:

* **Linear spline in 1/d.**  Positive by construction (each pixel is a convex combination of two positive
  knot values; a cubic spline through positive knots can dip below 0, where the Poisson likelihood of a
  pixel without a model spot is undefined), local (a pixel depends on two knots: the knots' Fisher matrix is
  tridiagonal and well conditioned) and cheap (two multiply-adds per pixel).  ``1/d`` because solvent, ice
  and air scattering are functions of the scattering angle with features of roughly constant width in
  ``1/d``, so evenly spaced knots resolve them alike at every resolution.
* **At most 16 knots**: the spline's weight table holds K numbers per pixel while it is evaluated.
* **The coordinate held.**  Each pixel's ``s`` comes from the starting geometry and is not re-computed while
  the geometry refines: the background stays linear in its knots and independent of the distance and the
  beam centre, so it cannot pull them (a 1-2 px change of the beam moves ``s`` by well under a knot interval).
* **Knots start** from a robust fit of the fitted pixels between spots: per knot, the clipped mean
  (:func:`clipped_mean`) of the pixels nearest that knot, farther than :data:`SPOT_CORE_PX` from every
  observed spot when the spots are known.
* **Planes held.**  One plane per window is 3 nuisance parameters per spot (about 1500 on a thaumatin still):
  held, they cost nothing per evaluation and leave the esds of the physical parameters unchanged.

The functions :func:`linear_spline` and :func:`plane_photons` are the physics (tensors in, tensors out);
:class:`BackgroundModel` holds a run's per-pixel tables (over the simulator's ROI) and gives ``B`` on a view's
pixels; :func:`resolution_background` and :func:`plane_background` build it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from nbtorch.errors import InputError

__all__ = ["KINDS", "DEFAULT_KNOTS", "MAX_KNOTS", "SPOT_CORE_PX", "PLANE_FLOOR", "BackgroundSpec", "parse_background",
           "knot_names", "is_knot", "linear_spline", "plane_photons", "clipped_mean", "BackgroundModel",
           "resolution_background", "plane_background", "fit_window_planes", "AUTO", "resolve_auto"]

#: the kinds ``--background`` accepts (``resolution`` takes ``:K``)
KINDS = ("constant", "planar", "resolution", "planes")
#: knots of ``resolution`` without ``:K``
DEFAULT_KNOTS = 6
#: most knots ``resolution:K`` accepts
MAX_KNOTS = 16
#: pixels closer than this (px) to an observed spot are left out of the background fits
SPOT_CORE_PX = 3.0
#: lowest photons/pixel a held plane gives (a plane extrapolated to a window's corner must stay positive)
PLANE_FLOOR = 0.1

#: the command's default ``--background``: :func:`resolve_auto` decides
AUTO = "auto"

_KNOT = re.compile(r"^background_(\d+)$")


@dataclass(frozen=True)
class BackgroundSpec:
    """A parsed ``--background``: ``kind`` (one of :data:`KINDS`) and ``knots`` (``resolution`` only, else 0)."""

    kind: str
    knots: int = 0

    @property
    def text(self) -> str:
        """The canonical text (``resolution:6``)."""
        return f"resolution:{self.knots}" if self.kind == "resolution" else self.kind

    @property
    def names(self) -> tuple[str, ...]:
        """The knot names refined with the group ``background`` (none unless ``resolution``)."""
        return knot_names(self.knots)


def parse_background(text: str) -> BackgroundSpec:
    """``constant``, ``planar``, ``resolution[:K]`` (2 <= K <= :data:`MAX_KNOTS`) or ``planes``; one-line errors."""
    value = str(text).strip()
    kind, _, count = value.partition(":")
    if kind not in KINDS:
        raise InputError(f"--background: unknown kind {kind!r}; valid: constant, planar, resolution[:K], planes")
    if kind != "resolution":
        if count:
            raise InputError(f"--background: {kind} takes no ':{count}' (only resolution:K does)")
        return BackgroundSpec(kind)
    if not count:
        return BackgroundSpec(kind, DEFAULT_KNOTS)
    try:
        k = int(count)
    except ValueError:
        raise InputError(f"--background: resolution:K needs an integer knot count, got {count!r}") from None
    if not 2 <= k <= MAX_KNOTS:
        raise InputError(f"--background: resolution:{k}: the knot count must be 2 to {MAX_KNOTS}")
    return BackgroundSpec(kind, k)


def resolve_auto(text: str, measured: bool, windows: bool) -> str:
    """``text``, or for :data:`AUTO` the default chosen from the thaumatin stills (docs/still-from-images.md, "What each
    model term removes"): ``planes`` for a measured image fitted in spot windows (observed spots and a window),
    ``constant`` otherwise (simulated problems, whole images, joint runs)."""
    if str(text).strip() != AUTO:
        return text
    return "planes" if measured and windows else "constant"


def knot_names(knots: int) -> tuple[str, ...]:
    """``background_0 .. background_{knots-1}``."""
    return tuple(f"background_{k}" for k in range(int(knots)))


def is_knot(name: str) -> bool:
    """True for a knot name ``background_<k>``."""
    return _KNOT.match(name) is not None


# ------------------------------------------------------------------------------------------ the physics


def linear_spline(knot_values: Tensor, u: Tensor) -> Tensor:
    """The linear spline through ``knot_values`` (K,) at knot coordinates ``u`` (any shape; knot ``k`` at
    ``u = k``; held constant beyond the first and last knot): photons per pixel, shape of ``u``.

    Written as a sum of hat functions ``max(0, 1 - |u - k|)`` times the knot values (a (..., K) weight table and
    one matrix-vector product): its backward is a matrix product too, where a gather of the two neighbouring knots
    would scatter-add 2 values per pixel into K slots (measured 30-100x slower on a CPU).
    """
    k = knot_values.shape[0]
    grid = torch.arange(k, dtype=u.dtype, device=u.device)
    hats = (1.0 - (u.clamp(0.0, float(k - 1))[..., None] - grid).abs()).clamp(min=0.0)
    return hats @ knot_values.to(u.dtype)


def plane_photons(coefficients: Tensor, window: Tensor, dx: Tensor, dy: Tensor, floor: float = PLANE_FLOOR) -> Tensor:
    """``max(a + b dx + c dy, floor)`` of each pixel's window: ``coefficients`` (W, 3) per window, ``window`` the
    pixels' window indices (long, 0..W-1), ``dx, dy`` their offsets (px) from the window's spot pixel."""
    c = coefficients[window]
    return torch.clamp(c[..., 0] + c[..., 1] * dx + c[..., 2] * dy, min=floor)


def clipped_mean(counts: np.ndarray, sigmas: float = 4.0) -> float:
    """Mean of Poisson counts after leaving out those above ``median + sigmas sqrt(median)`` (spot peaks, hot
    pixels): the level of a Poisson background, unbiased where no spot is left (unlike the median)."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0:
        return float("nan")
    med = float(np.median(counts))
    kept = counts[counts <= med + sigmas * math.sqrt(max(med, 1.0))]
    return float(kept.mean()) if kept.size else med


# ------------------------------------------------------------------------------------------ a run's tables


def _keeps_tables(device) -> bool:
    """Whether :meth:`BackgroundModel._table` keeps what it makes on ``device``: on a GPU."""
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class BackgroundModel:
    """A run's background with its per-pixel tables over ``roi`` (the simulator's, inclusive fast/slow bounds).

    Attributes:
        spec: what it is (:class:`BackgroundSpec`).
        roi: (x0, x1, y0, y1) the tables' rectangle.
        coordinate: ``resolution``: each pixel's knot coordinate ``u`` (knot ``k`` at ``u = k``), (h, w).
        held: ``planes``: each pixel's held background (photons), NaN outside every window, (h, w).
        start: starting values of the names it adds (the knots), photons/pixel.
        s_knots: ``resolution``: the knots' ``1/d`` (1/Å); ``windows``: ``planes``: windows with a plane.
    """

    spec: BackgroundSpec
    roi: tuple[int, int, int, int]
    coordinate: Tensor | None = None
    held: Tensor | None = None
    start: Mapping[str, float] | None = None
    s_knots: tuple[float, ...] = ()
    windows: int = 0

    @property
    def text(self) -> str:
        return self.spec.text

    @property
    def names(self) -> tuple[str, ...]:
        return self.spec.names

    def _table(self, roi: tuple[int, int, int, int], used: Tensor | None, dtype, device) -> Tensor:
        """The table (coordinates or held photons) on ``roi`` or its positions ``used``, in ``dtype`` on ``device``.
        On a GPU it is made once per request and kept (an evaluation asks for the same one every time; making it
        is a host-to-device copy, which a CUDA graph's capture may not contain: :mod:`nbtorch.runtime.cuda_graph`),
        never dropped (a captured graph may read it), at most 8 of them; on a CPU it is made at each call (a
        many-still run holds no second copy per still)."""
        key = (tuple(roi), str(dtype), str(device), id(used))  # the id is safe: the entry keeps ``used`` alive
        kept = self.__dict__.setdefault("_tables", {}).get(key)
        if kept is not None and kept[0] is used:
            return kept[1]
        x0, x1, y0, y1 = roi
        X0, _, Y0, _ = self.roi
        table = self.coordinate if self.coordinate is not None else self.held
        part = table[y0 - Y0:y1 - Y0 + 1, x0 - X0:x1 - X0 + 1].to(dtype=dtype, device=device)
        part = part if used is None else part.reshape(-1)[used.to(device)]
        if _keeps_tables(device) and len(self._tables) < 8:
            self._tables[key] = (used, part)
        return part

    def photons(self, values: Mapping[str, Tensor | float], roi: tuple[int, int, int, int],
                used: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``B`` on the rectangle ``roi`` (inside :attr:`roi`), or on its flat positions ``used`` (row-major)."""
        table = self._table(roi, used, dtype, device)
        if self.spec.kind == "resolution":
            knots = torch.stack([torch.as_tensor(values[n], dtype=dtype).to(device) for n in self.names])
            return linear_spline(knots, table)
        flat = torch.as_tensor(values["background"], dtype=dtype).to(device)
        return torch.where(torch.isnan(table), flat, table)

    def image(self, values: Mapping[str, float], shape: tuple[int, int]) -> np.ndarray:
        """``B`` (photons) on a whole (slow, fast) image of ``shape``: the model inside :attr:`roi`, the flat
        ``background`` outside it."""
        out = np.full(tuple(shape), float(values.get("background", 0.0)))
        x0, x1, y0, y1 = self.roi
        with torch.no_grad():
            part = self.photons(values, self.roi, None, torch.float64, torch.device("cpu"))
        out[y0:y1 + 1, x0:x1 + 1] = part.numpy()
        return out

    def describe(self) -> dict:
        """What ``result.json`` and the summary say of it."""
        out: dict = {"kind": self.spec.kind, "text": self.text}
        if self.s_knots:
            out["knots_d_A"] = [round(1.0 / s, 4) if s > 0 else None for s in self.s_knots]
        if self.spec.kind == "planes":
            out["windows"] = self.windows
        return out


def resolution_background(d_A: np.ndarray, roi: tuple[int, int, int, int], observed: np.ndarray, fitted: np.ndarray,
                          spec: BackgroundSpec, spots: np.ndarray | None = None) -> BackgroundModel:
    """The ``resolution:K`` background: knots evenly spaced in ``1/d`` over the fitted pixels, started from the
    clipped mean of the pixels between spots nearest each knot (:func:`clipped_mean`).

    Arguments:
        d_A: (slow, fast) resolution of each pixel at the start (Å; inf at the beam, NaN unknown), over the image.
        roi: the simulator's rectangle (x0, x1, y0, y1); observed, fitted: (slow, fast) photons and fitted pixels.
        spots: (n, 2+) observed spots (x fast, y slow, px) or None.
    """
    x0, x1, y0, y1 = roi
    s = 1.0 / np.asarray(d_A, dtype=np.float64)[y0:y1 + 1, x0:x1 + 1]
    fit = np.asarray(fitted, dtype=bool)[y0:y1 + 1, x0:x1 + 1] & np.isfinite(s)
    if not fit.any():
        raise InputError("--background resolution: no fitted pixel has a known resolution")
    lo, hi = float(s[fit].min()), float(s[fit].max())
    hi = hi if hi > lo else lo + 1e-3
    k = spec.knots
    u = np.where(np.isfinite(s), (s - lo) / (hi - lo) * (k - 1), 0.0)
    between = fit & ~_near_spots(fit.shape, spots, x0, y0)
    obs = np.asarray(observed, dtype=np.float64)[y0:y1 + 1, x0:x1 + 1]
    nearest = np.rint(np.clip(u, 0, k - 1)).astype(int)
    level = clipped_mean(obs[between]) if between.any() else clipped_mean(obs[fit])
    start = {}
    for i, name in enumerate(spec.names):
        pick = between & (nearest == i)
        value = clipped_mean(obs[pick]) if pick.sum() >= 20 else level
        start[name] = max(value, PLANE_FLOOR) if math.isfinite(value) else max(level, PLANE_FLOOR)
    knots_s = tuple(lo + (hi - lo) * i / (k - 1) for i in range(k))
    return BackgroundModel(spec=spec, roi=roi, coordinate=torch.from_numpy(u), start=start, s_knots=knots_s)


def _near_spots(shape: tuple[int, int], spots: np.ndarray | None, x0: int, y0: int,
                radius: float = SPOT_CORE_PX) -> np.ndarray:
    """Bool (h, w) of a rectangle starting at (x0, y0): True within ``radius`` px of a spot's centre."""
    out = np.zeros(shape, dtype=bool)
    if spots is None:
        return out
    r = int(math.ceil(radius))
    h, w = shape
    for x, y in np.asarray(spots, dtype=np.float64).reshape(len(spots), -1)[:, :2]:
        i, j = int(math.floor(x)) - x0, int(math.floor(y)) - y0
        ja, jb, ia, ib = max(j - r, 0), min(j + r + 1, h), max(i - r, 0), min(i + r + 1, w)
        if ja >= jb or ia >= ib:
            continue
        yy, xx = np.mgrid[ja:jb, ia:ib]
        out[ja:jb, ia:ib] |= (xx + 0.5 - (x - x0)) ** 2 + (yy + 0.5 - (y - y0)) ** 2 <= radius * radius
    return out


def fit_window_planes(observed: np.ndarray, fitted: np.ndarray, spots: np.ndarray,
                      half_px: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per spot window (a square of ``half_px`` around each spot's pixel; a pixel in several belongs to the
    nearest spot): the least-squares plane ``a + b dx + c dy`` of its fitted pixels farther than
    :data:`SPOT_CORE_PX` from every spot, after one clip of counts above ``median + 4 sqrt(median)``; a window
    with under 12 such pixels gets their clipped mean and no slope, one with under 3 no plane.

    Returns ``(coefficients (W, 3), window (slow, fast) int, -1 outside), has_plane (W,) bool)``.
    """
    ny, nx = observed.shape
    spots = np.asarray(spots, dtype=np.float64).reshape(len(spots), -1)[:, :2]
    window = np.full((ny, nx), -1, dtype=np.int64)
    best = np.full((ny, nx), np.inf)
    for w, (x, y) in enumerate(spots):
        i, j = int(math.floor(x)), int(math.floor(y))
        ja, jb, ia, ib = max(j - half_px, 0), min(j + half_px + 1, ny), max(i - half_px, 0), min(i + half_px + 1, nx)
        if ja >= jb or ia >= ib:
            continue
        yy, xx = np.mgrid[ja:jb, ia:ib]
        dist = (xx - i) ** 2 + (yy - j) ** 2
        closer = dist < best[ja:jb, ia:ib]
        best[ja:jb, ia:ib] = np.where(closer, dist, best[ja:jb, ia:ib])
        window[ja:jb, ia:ib] = np.where(closer, w, window[ja:jb, ia:ib])
    core = _near_spots((ny, nx), spots, 0, 0)
    coefficients = np.zeros((len(spots), 3))
    has = np.zeros(len(spots), dtype=bool)
    usable = np.asarray(fitted, dtype=bool) & ~core & (window >= 0)
    for w, (x, y) in enumerate(spots):
        i, j = int(math.floor(x)), int(math.floor(y))
        ja, ia = max(j - half_px, 0), max(i - half_px, 0)
        box = (slice(ja, max(min(j + half_px + 1, ny), ja)), slice(ia, max(min(i + half_px + 1, nx), ia)))
        ys, xs = np.nonzero(usable[box] & (window[box] == w))
        ys, xs = ys + ja, xs + ia
        coefficients[w], has[w] = _plane(observed[ys, xs], xs - i, ys - j)
    return coefficients, window, has


def _plane(counts: np.ndarray, dx: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, bool]:
    """One window's plane (see :func:`fit_window_planes`)."""
    if counts.size < 3:
        return np.zeros(3), False
    med = float(np.median(counts))
    keep = counts <= med + 4.0 * math.sqrt(max(med, 1.0))
    counts, dx, dy = counts[keep], dx[keep], dy[keep]
    if counts.size < 12:
        return np.array([max(float(counts.mean()), PLANE_FLOOR), 0.0, 0.0]), True
    a = np.stack([np.ones_like(dx, dtype=np.float64), dx, dy], axis=1).astype(np.float64)
    coef, *_ = np.linalg.lstsq(a, counts.astype(np.float64), rcond=None)
    return coef, True


def plane_background(observed: np.ndarray, fitted: np.ndarray, spots: np.ndarray | None, half_px: int | None,
                     roi: tuple[int, int, int, int]) -> BackgroundModel:
    """The held ``planes`` background (:func:`fit_window_planes`) over the simulator's ``roi``; one-line errors
    without spots or windows, or with a window larger than the image."""
    if spots is None or len(spots) == 0:
        raise InputError("--background planes: needs observed spots (--spots or --refl) to place the windows")
    if half_px is None:
        raise InputError("--background planes: needs --spot-window (the half-width of each spot's window)")
    ny, nx = np.shape(observed)
    if 2 * int(half_px) + 1 > min(ny, nx):
        raise InputError(f"--background planes: a window of {2 * int(half_px) + 1} px is larger than the image "
                         f"({nx} x {ny} px)")
    obs = np.asarray(observed, dtype=np.float64)
    coefficients, window, has = fit_window_planes(obs, fitted, spots, int(half_px))
    x0, x1, y0, y1 = roi
    win = window[y0:y1 + 1, x0:x1 + 1]
    ys, xs = np.mgrid[y0:y1 + 1, x0:x1 + 1]
    spot_x = np.floor(np.asarray(spots, dtype=np.float64).reshape(len(spots), -1)[:, 0])
    spot_y = np.floor(np.asarray(spots, dtype=np.float64).reshape(len(spots), -1)[:, 1])
    inside = (win >= 0) & has[np.maximum(win, 0)]
    idx = torch.from_numpy(np.maximum(win, 0))
    dx = torch.from_numpy((xs - spot_x[np.maximum(win, 0)]).astype(np.float64))
    dy = torch.from_numpy((ys - spot_y[np.maximum(win, 0)]).astype(np.float64))
    held = plane_photons(torch.from_numpy(coefficients), idx, dx, dy)
    held = torch.where(torch.from_numpy(inside), held, torch.full_like(held, float("nan")))
    return BackgroundModel(spec=BackgroundSpec("planes"), roi=roi, held=held, start={}, windows=int(has.sum()))
