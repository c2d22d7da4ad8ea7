"""What the refined model still misses: diagnostics that judge each model term by what it leaves behind.

The fit excess (:mod:`refine.quality.fit_quality`) says *how much* the model misses; these say *where*:

* :func:`poisson_z_spread`, **sigZ**: the standard deviation of the per-pixel Poisson z-score
  ``z = (observed - model) / sqrt(model)`` over the fitted pixels (1 for a model that explains the image down to
  its shot noise, whatever the counts), the mean z and the fraction of pixels with ``|z| > 5``;
* :func:`stacked_profile`, the **stacked spot profile**: around every matched spot a ``(2 half_px + 1)^2`` grid of
  observed and model photons, sampled bilinearly on the observed centroid in the spot's own frame (columns:
  radial, outward from the direct beam; rows: tangential), summed over the spots.  Observed and model are
  resampled alike, so their stacks compare spot shapes (peak, rms radius radially and tangentially, the tails
  3-5 px out) whatever their orientation on the detector;
* :func:`background_by_resolution`: the fitted pixels farther than ``exclude_px`` from every observed spot and
  every pixel where the model has a spot, binned by resolution (d, Å; equal pixel counts in ``1/d^2``): mean
  observed against mean model photons per bin.

:func:`spot_misfit` assembles the last two for ``nbtorch-refine`` from what the run already has (the spot report's
rendered windows and the final model image: nothing is simulated again) and the simulator's geometry
(:meth:`nbtorch.Simulator.geometry` for the direct beam, :func:`refine.inputs.selection.resolution_map` for d).
The functions before it are pure functions of arrays.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from nbtorch.parameters import PARAMETER_NAMES
from refine.inputs.selection import resolution_map
from refine.inputs.spots import SpotOffsets, window_mask
from refine.quality.fit_quality import SIGNAL_SIGMA, background_image

__all__ = ["ZSpread", "poisson_z_spread", "SpotProfile", "stacked_profile", "BackgroundByResolution",
           "background_by_resolution", "direct_beam_px", "spot_misfit", "PROFILE_HALF_PX", "EXCLUDE_PX",
           "RESOLUTION_BINS", "Z_OUTLIER"]

log = logging.getLogger(__name__)

#: half-width (px) of the stacked spot profile: an 11 x 11 grid, the tutorial's spot windows
PROFILE_HALF_PX = 5
#: the background between spots: fitted pixels farther than this (px, a square) from every spot
EXCLUDE_PX = 5
#: resolution bins of the background between spots (equal pixel counts in 1/d^2)
RESOLUTION_BINS = 8
#: |z| above this counts as an outlier pixel (Poisson noise alone: ~6e-7 of the pixels for large counts)
Z_OUTLIER = 5.0
#: the median absolute deviation of a normal distribution, in standard deviations
_MAD_TO_SIGMA = 1.4826
#: the tails of the profile: samples this far from the centre (px, inclusive)
_TAIL_PX = (3.0, 5.0)


# ------------------------------------------------------------------------------------------ sigZ

@dataclass(frozen=True)
class ZSpread:
    """The per-pixel Poisson z-scores of the fitted pixels (:func:`poisson_z_spread`).

    Attributes:
        sigZ: their standard deviation (1 = shot noise only).
        sigZ_robust: 1.4826 x their median absolute deviation from the median (the sigZ of the typical pixel:
            a few pixels far off, such as the peaks of spots the model gets too weak, barely move it).
        mean_z: their mean (> 0: the model too low on average).
        fraction_above: the fraction with ``|z| >`` :data:`Z_OUTLIER`.
        pixels: the pixels counted (fitted, finite, model > 0).
    """

    sigZ: float
    sigZ_robust: float
    mean_z: float
    fraction_above: float
    pixels: int

    def to_dict(self) -> dict[str, float | int]:
        """The ``diagnostics`` fields of ``result.json``."""
        return {"sigZ": self.sigZ, "sigZ_robust": self.sigZ_robust, "mean_z": self.mean_z,
                "fraction_z_above_5": self.fraction_above, "z_pixels": self.pixels}


def poisson_z_spread(observed: np.ndarray, model: np.ndarray, fitted: np.ndarray) -> ZSpread:
    """sigZ of ``observed`` counts against ``model`` photons (same shape) over the True pixels of ``fitted``.

    ``z = (observed - model) / sqrt(model)``; pixels with a model <= 0 or a non-finite value are left out.
    """
    obs = np.asarray(observed, dtype=np.float64)
    mod = np.asarray(model, dtype=np.float64)
    use = np.asarray(fitted, dtype=bool) & np.isfinite(obs) & np.isfinite(mod) & (mod > 0)
    if not use.any():
        return ZSpread(math.nan, math.nan, math.nan, math.nan, 0)
    m = mod[use]
    z = (obs[use] - m) / np.sqrt(m)
    return ZSpread(sigZ=float(z.std()), sigZ_robust=_MAD_TO_SIGMA * float(np.median(np.abs(z - np.median(z)))),
                   mean_z=float(z.mean()), fraction_above=float(np.mean(np.abs(z) > Z_OUTLIER)),
                   pixels=int(z.size))


# ------------------------------------------------------------------------------------------ the spot profile

@dataclass(frozen=True)
class SpotProfile:
    """Observed and model photons summed over spots in each spot's radial / tangential frame.

    Attributes:
        half_px: the grid's half-width (px); the stacks are ``(2 half_px + 1)^2``, rows tangential (v, px),
            columns radial (u, px, outward from the direct beam), the observed centroid at the centre.
        spots: spots stacked (matched, and every sample on usable, rendered pixels).
        observed, model: the stacks (photons, summed over the spots; background included).
        offsets_radial_px, offsets_tangential_px: (spots,) each stacked spot's model - observed centroid offset
            projected on its frame (NaN where unknown).
        model_own: the model stacked about its *own* centroids (observed centroid + offset), in the same frames,
            over the ``own_spots`` spots whose grid lies on rendered pixels both ways (None without offsets).
            Stacked on the observed centroids, a model whose spots sit beside the observed ones is smeared by
            the offsets (its rms radius grows by about the offsets' rms in quadrature): this stack separates
            the spot's shape from its position.
    """

    half_px: int
    spots: int
    observed: np.ndarray = field(repr=False)
    model: np.ndarray = field(repr=False)
    offsets_radial_px: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    offsets_tangential_px: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    model_own: np.ndarray | None = field(repr=False, default=None)
    own_spots: int = 0

    @property
    def difference(self) -> np.ndarray:
        """observed - model (photons, summed over the spots)."""
        return self.observed - self.model

    def _grid(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        u = np.arange(-self.half_px, self.half_px + 1, dtype=np.float64)
        uu, vv = np.meshgrid(u, u)  # columns radial, rows tangential
        return uu, vv, np.hypot(uu, vv)

    def shape_numbers(self, stack: np.ndarray, spots: int | None = None) -> dict[str, float | list[float]]:
        """Per spot (of ``spots`` stacked, default :attr:`spots`): ``background_per_spot`` (photons/pixel: the mean beyond ``half_px`` from the centre, the
        grid's corners), ``peak_per_spot`` and ``integrated_per_spot`` (photons above it: the largest sample, and
        the sum within ``half_px``), ``rms_radius_px``, ``rms_radial_px``, ``rms_tangential_px`` (second
        moments about the centre of the positive part above the background within ``half_px``) and
        ``centroid_px`` [u, v]."""
        uu, vv, rr = self._grid()
        n = max(self.spots if spots is None else spots, 1)
        corners, core = rr > self.half_px, rr <= self.half_px
        bg = float(stack[corners].mean()) if corners.any() else 0.0
        net = stack - bg
        w = np.where(core, np.clip(net, 0.0, None), 0.0)
        total = float(w.sum())
        if not total > 0:
            nan = math.nan
            return {"background_per_spot": bg / n, "peak_per_spot": float(net.max()) / n,
                    "integrated_per_spot": float(net[core].sum()) / n, "rms_radius_px": nan, "rms_radial_px": nan,
                    "rms_tangential_px": nan, "centroid_px": [nan, nan]}
        su, sv = float((w * uu * uu).sum() / total), float((w * vv * vv).sum() / total)
        return {"background_per_spot": bg / n, "peak_per_spot": float(net.max()) / n,
                "integrated_per_spot": float(net[core].sum()) / n, "rms_radius_px": math.sqrt(su + sv),
                "rms_radial_px": math.sqrt(su), "rms_tangential_px": math.sqrt(sv),
                "centroid_px": [float((w * uu).sum() / total), float((w * vv).sum() / total)]}

    @property
    def tail_excess(self) -> float:
        """model / observed - 1 of the stacked photons (background included) 3-5 px from the centre."""
        _, _, rr = self._grid()
        ring = (rr >= _TAIL_PX[0]) & (rr <= _TAIL_PX[1])
        obs = float(self.observed[ring].sum())
        return float(self.model[ring].sum()) / obs - 1.0 if obs > 0 else math.nan

    def to_dict(self) -> dict:
        """``diagnostics.profile`` of ``result.json``: the numbers and the three stacks as nested lists."""
        def rms(a: np.ndarray) -> float:
            a = a[np.isfinite(a)]
            return float(np.sqrt(np.mean(a * a))) if a.size else math.nan

        out = {"spots": self.spots, "half_px": self.half_px,
               "axes": "rows: tangential (px); columns: radial (px, outward from the direct beam); "
                       "the observed centroid at the centre",
               "observed": self.shape_numbers(self.observed), "model": self.shape_numbers(self.model),
               "excess_3to5_px": self.tail_excess,
               "offset_rms_px": {"radial": rms(self.offsets_radial_px),
                                 "tangential": rms(self.offsets_tangential_px)},
               "stack_observed": self.observed.tolist(), "stack_model": self.model.tolist(),
               "stack_difference": self.difference.tolist()}
        if self.model_own is not None and self.own_spots:
            out.update(model_own=self.shape_numbers(self.model_own, self.own_spots), own_spots=self.own_spots,
                       stack_model_own=self.model_own.tolist())
        return out


def _bilinear(image: np.ndarray, valid: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``image`` sampled bilinearly at (x, y) (px, pixel centres at i + 0.5) and whether all four pixels used are
    on the image and ``valid``."""
    fx, fy = x - 0.5, y - 0.5
    i0, j0 = np.floor(fx).astype(np.int64), np.floor(fy).astype(np.int64)
    tx, ty = fx - i0, fy - j0
    ny, nx = image.shape
    ok = (i0 >= 0) & (j0 >= 0) & (i0 + 1 < nx) & (j0 + 1 < ny)
    i0, j0 = np.where(ok, i0, 0), np.where(ok, j0, 0)
    out = np.zeros(x.shape)
    for dj, di, wt in ((0, 0, (1 - tx) * (1 - ty)), (0, 1, tx * (1 - ty)), (1, 0, (1 - tx) * ty), (1, 1, tx * ty)):
        ok &= valid[j0 + dj, i0 + di]
        out += wt * image[j0 + dj, i0 + di]
    return out, ok


def stacked_profile(observed: np.ndarray, model: np.ndarray, valid: np.ndarray, spots_xy: np.ndarray,
                    beam_xy: tuple[float, float], *, half_px: int = PROFILE_HALF_PX,
                    offsets_xy: np.ndarray | None = None) -> SpotProfile:
    """The :class:`SpotProfile` of ``spots_xy`` (n, 2: observed centroids x, y, px).

    Arguments:
        observed, model: (slow, fast) photons; ``valid``: (slow, fast) bool, pixels usable in both (a spot with
            any sample touching another pixel is left out).
        beam_xy: the direct beam's position on the detector (x, y, px): the radial direction of a spot points
            from it to the spot (a spot on it: radial along +x).
        half_px: the grid's half-width (px).
        offsets_xy: (n, 2) model - observed centroid offsets (px) to project on each spot's frame (optional).
    """
    spots = np.asarray(spots_xy, dtype=np.float64).reshape(-1, 2)
    obs, mod = np.asarray(observed, dtype=np.float64), np.asarray(model, dtype=np.float64)
    valid = np.asarray(valid, dtype=bool) & np.isfinite(obs) & np.isfinite(mod)
    size = 2 * half_px + 1
    if not len(spots):
        return SpotProfile(half_px, 0, np.zeros((size, size)), np.zeros((size, size)))
    radial = spots - np.asarray(beam_xy, dtype=np.float64)[None, :]
    length = np.hypot(radial[:, 0], radial[:, 1])
    er = np.where(length[:, None] > 0, radial / np.where(length > 0, length, 1.0)[:, None], [1.0, 0.0])
    et = np.stack([-er[:, 1], er[:, 0]], axis=1)  # the radial direction turned by +90 degrees
    u = np.arange(-half_px, half_px + 1, dtype=np.float64)
    uu, vv = np.meshgrid(u, u)  # (size, size): columns radial, rows tangential
    x = spots[:, 0, None, None] + uu[None] * er[:, 0, None, None] + vv[None] * et[:, 0, None, None]
    y = spots[:, 1, None, None] + uu[None] * er[:, 1, None, None] + vv[None] * et[:, 1, None, None]
    o, ok = _bilinear(obs, valid, x, y)
    m, _ = _bilinear(mod, valid, x, y)
    keep = ok.reshape(len(spots), -1).all(axis=1)
    radial_off = tangential_off = np.zeros(0)
    own, own_spots = None, 0
    if offsets_xy is not None:
        d_all = np.asarray(offsets_xy, dtype=np.float64).reshape(-1, 2)
        d = d_all[keep]
        radial_off, tangential_off = (d * er[keep]).sum(axis=1), (d * et[keep]).sum(axis=1)
        known = np.isfinite(d_all).all(axis=1)
        shift = np.where(known[:, None], d_all, 0.0)
        mo, ok_own = _bilinear(mod, valid, x + shift[:, 0, None, None], y + shift[:, 1, None, None])
        both = keep & ok_own.reshape(len(spots), -1).all(axis=1) & known
        own, own_spots = mo[both].sum(axis=0), int(both.sum())
    return SpotProfile(half_px=half_px, spots=int(keep.sum()), observed=o[keep].sum(axis=0),
                       model=m[keep].sum(axis=0), offsets_radial_px=radial_off, offsets_tangential_px=tangential_off,
                       model_own=own, own_spots=own_spots)


# ------------------------------------------------------------------------------------------ background

@dataclass(frozen=True)
class BackgroundByResolution:
    """Mean observed and model photons per pixel between spots, per resolution bin (:func:`background_by_resolution`).

    Attributes:
        exclude_px: pixels within this distance (px, a square) of a spot were left out.
        d_max_A, d_min_A: each bin's resolution range (Å, low resolution first).
        pixels: pixels per bin; ``observed``, ``model``: mean photons per pixel per bin.
        sigZ: the spread of the Poisson z-scores of the pixels between spots (all bins; :func:`poisson_z_spread`).
    """

    exclude_px: int
    d_max_A: np.ndarray
    d_min_A: np.ndarray
    pixels: np.ndarray
    observed: np.ndarray
    model: np.ndarray
    sigZ: float = math.nan

    def to_dict(self) -> dict:
        """``diagnostics.background_by_resolution`` of ``result.json``."""
        n = int(self.pixels.sum())
        mean = (lambda a: float((a * self.pixels).sum() / n)) if n else (lambda a: math.nan)
        return {"exclude_px": self.exclude_px, "pixels": n, "observed_mean": mean(self.observed),
                "model_mean": mean(self.model), "sigZ": self.sigZ,
                "bins": [{"d_max_A": float(a), "d_min_A": float(b), "pixels": int(p), "observed_mean": float(o),
                          "model_mean": float(m)}
                         for a, b, p, o, m in zip(self.d_max_A, self.d_min_A, self.pixels, self.observed, self.model)]}


def _dilate(mask: np.ndarray, half: int) -> np.ndarray:
    """Bool: True within ``half`` pixels (a square) of a True pixel of ``mask`` (an integral image's box sum)."""
    if half <= 0:
        return mask.copy()
    c = np.pad(mask.astype(np.int32), ((1, 0), (1, 0))).cumsum(0).cumsum(1)
    ny, nx = mask.shape
    y0, y1 = np.clip(np.arange(ny) - half, 0, ny), np.clip(np.arange(ny) + half + 1, 0, ny)
    x0, x1 = np.clip(np.arange(nx) - half, 0, nx), np.clip(np.arange(nx) + half + 1, 0, nx)
    return (c[y1][:, x1] - c[y0][:, x1] - c[y1][:, x0] + c[y0][:, x0]) > 0


def background_by_resolution(observed: np.ndarray, model: np.ndarray, bragg: np.ndarray, fitted: np.ndarray,
                             d_A: np.ndarray, spots_xy: np.ndarray, *, exclude_px: int = EXCLUDE_PX,
                             bins: int = RESOLUTION_BINS) -> BackgroundByResolution:
    """Observed against model photons between spots, by resolution.

    Arguments:
        observed, model: (slow, fast) photons; ``bragg``: the model's Bragg part (model minus its background).
        fitted: (slow, fast) bool, the pixels with a model (the fitted ones).
        d_A: (slow, fast) resolution (Å) of each pixel (NaN: unknown, left out; inf: the direct beam).
        spots_xy: (n, 2) observed spots (and any model spot positions to leave out), x, y px.
        exclude_px: pixels within this distance (a square) of a spot, or of a fitted pixel where the model's Bragg
            part is at least :data:`refine.quality.fit_quality.SIGNAL_SIGMA` sqrt(background), are left out.
        bins: resolution bins, equal pixel counts in ``1/d^2`` (fewer when there are fewer pixels).
    """
    fitted = np.asarray(fitted, dtype=bool)
    ys, xs = np.nonzero(fitted)
    empty = BackgroundByResolution(exclude_px, *(np.zeros(0) for _ in range(5)))
    if not ys.size:
        return empty
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1  # the fitted pixels' box only
    box = np.s_[y0:y1, x0:x1]
    obs, mod, brg = (np.asarray(a, dtype=np.float64)[box] for a in (observed, model, bragg))
    fit, d = fitted[box], np.asarray(d_A, dtype=np.float64)[box]
    background = np.maximum(mod - brg, 1.0)
    signal = fit & (brg >= SIGNAL_SIGMA * np.sqrt(background))
    near = _dilate(signal, exclude_px)
    spots = np.asarray(spots_xy, dtype=np.float64).reshape(-1, 2) - [x0, y0]
    near |= window_mask(fit.shape, spots[np.isfinite(spots).all(axis=1)], exclude_px)
    with np.errstate(divide="ignore"):
        inv_d2 = np.where(np.isnan(d) | (d <= 0), np.nan, 1.0 / (d * d))
    use = fit & ~near & np.isfinite(inv_d2) & np.isfinite(obs) & np.isfinite(mod)
    if not use.any():
        return empty
    s, o, m = inv_d2[use], obs[use], mod[use]
    order = np.argsort(s, kind="stable")
    groups = [g for g in np.array_split(order, max(1, min(int(bins), s.size))) if g.size]
    with np.errstate(divide="ignore"):
        d_max = np.array([1.0 / math.sqrt(s[g[0]]) if s[g[0]] > 0 else math.inf for g in groups])
        d_min = np.array([1.0 / math.sqrt(s[g[-1]]) if s[g[-1]] > 0 else math.inf for g in groups])
    return BackgroundByResolution(exclude_px=exclude_px, d_max_A=d_max, d_min_A=d_min,
                                  pixels=np.array([g.size for g in groups]),
                                  observed=np.array([o[g].mean() for g in groups]),
                                  model=np.array([m[g].mean() for g in groups]),
                                  sigZ=poisson_z_spread(o, m, np.ones(o.shape, dtype=bool)).sigZ)


# ------------------------------------------------------------------------------------------ the command's part

def direct_beam_px(sim, values: Mapping[str, float] | None = None) -> tuple[float, float]:
    """Where the direct beam meets the detector plane (x fast, y slow; px from the corner of pixel (0, 0)) for the
    canonical ``values`` (the simulator's own where absent), from :meth:`nbtorch.Simulator.geometry`."""
    names = set(PARAMETER_NAMES + (sim.panel_layout.names() if sim.panel_layout is not None else ()))
    overrides = {n: float(v) for n, v in (values or {}).items() if n in names}
    with torch.no_grad():  # a multi-panel detector: panel 0's plane, i.e. the stacked image's pixels
        g = sim.geometry(sim.parameters_dict(**overrides), panel=0 if sim.panel_layout is not None else None)
    pixel_m = float(sim.setup.pixel_m)
    return float(g.Fbeam) / pixel_m, float(g.Sbeam) / pixel_m


def spot_misfit(sim, params: Mapping[str, float], observed: np.ndarray, usable: np.ndarray, offsets: SpotOffsets,
                model: np.ndarray, fitted: np.ndarray, *, half_px: int = PROFILE_HALF_PX,
                exclude_px: int = EXCLUDE_PX, background: np.ndarray | None = None) -> dict:
    """``diagnostics.profile`` and ``diagnostics.background_by_resolution`` of a refined model.

    Arguments:
        sim: the simulator (its geometry only); ``params``: the refined values (canonical, ``scale``,
            ``background``...).
        observed, usable: the image (photons) and its usable pixels.
        offsets: :func:`refine.inputs.spots.spot_offsets` of the refined model with ``keep_model`` (its rendered
            windows around the observed spots give the profile's model; the matched spots are stacked).
        model, fitted: the final model image (photons) and the fitted pixels (the result's ``model``, ``mask``).
        background: the run's background image (photons; the result's ``background_image``) instead of the
            params' flat or planar one.
    """
    if offsets.bragg is None:
        raise ValueError("spot_misfit: the offsets keep no rendered model (SpotOffsets.bragg is None)")
    t0 = time.monotonic()
    if background is None:
        background = background_image(offsets.bragg.shape, dict(params))
    windows = float(params.get("scale", 1.0)) * offsets.bragg + background
    rendered = window_mask(offsets.bragg.shape, offsets.observed, offsets.window)
    matched = offsets.matched
    beam = direct_beam_px(sim, params)
    profile = stacked_profile(observed, windows, rendered & np.asarray(usable, dtype=bool),
                              offsets.observed[matched], beam, half_px=half_px,
                              offsets_xy=offsets.offsets[matched])
    ys, xs = np.nonzero(fitted)
    d_A = (resolution_map(sim, (int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())), params) if ys.size
           else np.full(np.shape(fitted), np.nan))
    spots = np.concatenate([offsets.observed, offsets.predicted[matched]])
    table = background_by_resolution(observed, model, model - background,
                                     fitted, d_A, spots, exclude_px=exclude_px)
    log.info("spot profile over %d spots and background between spots (%d pixels), %.2f s", profile.spots,
             int(table.pixels.sum()), time.monotonic() - t0)
    return {"direct_beam_px": list(beam), "profile": profile.to_dict(), "background_by_resolution": table.to_dict()}
