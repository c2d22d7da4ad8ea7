"""Summation integration of a still's predicted spots, and the model's photons per ``F^2`` on each spot's window.

The merges to beat (:mod:`experiments.merging`) start here.  For one still at given values (true or refined):

* :func:`pixel_indices`: the nearest Miller index of every pixel centre, ``round(a . S)`` with
  ``S = (d - s0) / lambda`` (``d`` the unit vector to the pixel centre, ``s0`` the first source's direction,
  1/A), the crystal at its central orientation (no mosaic domain);
* :func:`unit_image`: the model's Bragg photons per pixel with every amplitude 1 (``scale x`` the simulated image
  at ``default_F = 1``; the model holds no table): with the structure factors not interpolated, a pixel's Bragg
  photons are ``F(hkl)^2`` of its nearest reflection times this;
* :func:`predict_spots`: each reflection whose pixels carry at least ``min_unit`` photons per ``F^2``; its centre
  the photon-weighted mean of its pixels (slow, fast; pixel units, 0 = the first pixel's centre);
* :func:`integrate`: the observed counts in a disc of ``spot_radius_px`` about each centre minus the mean of
  its ring ``ring_px`` (inner, outer radius; the pixels of every spot's disc left out) per pixel; its variance
  ``sum(max(y - pedestal, 0)) + n_disc^2 var(ring) / n_ring``; and ``model``, the photons per ``F^2`` the model
  puts on the disc from the spot's own reflection (its *partiality*, with Lorentz, polarisation, scale and
  fluence), ``sum`` over the disc's pixels whose nearest reflection it is.  A spot whose disc leaves the detector
  or whose ring has fewer than ``min_ring_pixels`` pixels is dropped.

Arrays are (slow, fast) images; photons and counts are per pixel; the observed images are detector counts
(photons plus ``pedestal``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nbtorch.parameters import ORIENTATION_DELTAS, PARAMETER_NAMES

__all__ = ["Spots", "Integrated", "pixel_indices", "unit_image", "predict_spots", "integrate"]


@dataclass(frozen=True)
class Spots:
    """Predicted spots: ``hkl`` (n, 3) int, ``centre`` (n, 2) slow, fast (px), ``unit_photons`` (n,) model photons per
    ``F^2`` on all pixels of the reflection."""

    hkl: np.ndarray
    centre: np.ndarray
    unit_photons: np.ndarray


@dataclass(frozen=True)
class Integrated:
    """Integrated spots: ``hkl`` (n, 3), ``intensity`` (n,) background-subtracted photons on the disc, ``sigma``
    (n,) its esd, ``model`` (n,) the model's photons per ``F^2`` on the disc, ``background`` (n,) counts per pixel."""

    hkl: np.ndarray
    intensity: np.ndarray
    sigma: np.ndarray
    model: np.ndarray
    background: np.ndarray

    def __len__(self) -> int:
        return len(self.intensity)


def _overrides(sim, values: dict) -> dict:
    names = set(sim.parameter_names())
    return {k: torch.tensor(float(values[k]), dtype=sim.dtype) for k in PARAMETER_NAMES + ORIENTATION_DELTAS
            if k in values and k in names}


def pixel_indices(sim, values: dict) -> np.ndarray:
    """(3, slow, fast) int: the nearest Miller index of every pixel centre of ``sim`` at ``values`` (module
    docstring)."""
    with torch.no_grad():
        p = sim.parameters_dict(**_overrides(sim, values))
        g = sim.geometry(p)
        real, _ = sim.crystal_vectors(p)
        incident, wavelength_A = sim.sources(p)
    ns, nf = sim.shape
    pixel_m = float(sim.setup.detector.pixel_m)
    s, f = np.mgrid[0:ns, 0:nf].astype(np.float64)
    pos = (g.pix0.numpy()[:, None, None] + (f + 0.5) * pixel_m * g.fdet.numpy()[:, None, None]
           + (s + 0.5) * pixel_m * g.sdet.numpy()[:, None, None])
    d = pos / np.linalg.norm(pos, axis=0)
    S = (d - incident[0].numpy()[:, None, None]) / float(wavelength_A[0])
    return np.rint(np.einsum("ij,jsf->isf", real.numpy(), S)).astype(np.int64)


def unit_image(sim, values: dict) -> np.ndarray:
    """(slow, fast) the model's Bragg photons per pixel with every amplitude 1: ``values['scale'] x`` the image at
    ``default_F = 1`` (``sim`` must hold no amplitude table)."""
    if sim.setup.F_grid is not None:
        raise ValueError("unit_image: the simulator holds an amplitude table; give the model without one")
    over = _overrides(sim, values)
    over["default_F"] = torch.tensor(1.0, dtype=sim.dtype)
    with torch.no_grad():
        return float(values.get("scale", 1.0)) * sim(**over).cpu().numpy()


def predict_spots(hkl_px: np.ndarray, unit: np.ndarray, min_unit: float) -> Spots:
    """The reflections whose pixels carry at least ``min_unit`` model photons per ``F^2`` (module docstring).

    ``hkl_px``: (3, slow, fast) nearest indices; ``unit``: (slow, fast) photons per ``F^2``."""
    keys = hkl_px.reshape(3, -1).T
    w = unit.reshape(-1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    total = np.bincount(inv, weights=w, minlength=len(uniq))
    s, f = np.mgrid[0:unit.shape[0], 0:unit.shape[1]].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        cs = np.bincount(inv, weights=w * s.reshape(-1), minlength=len(uniq)) / total
        cf = np.bincount(inv, weights=w * f.reshape(-1), minlength=len(uniq)) / total
    keep = (total >= min_unit) & (total > 0) & ~np.all(uniq == 0, axis=1)
    return Spots(uniq[keep], np.stack([cs[keep], cf[keep]], 1), total[keep])


def integrate(observed: np.ndarray, spots: Spots, hkl_px: np.ndarray, unit: np.ndarray, *,
              spot_radius_px: float = 2.5, ring_px: tuple[float, float] = (4.0, 6.0), min_ring_pixels: int = 8,
              pedestal: float = 0.0) -> Integrated:
    """Summation integration of ``spots`` on the ``observed`` counts (module docstring)."""
    ns, nf = observed.shape
    s, f = np.mgrid[0:ns, 0:nf].astype(np.float64)
    r2_spot, (r_in, r_out) = spot_radius_px ** 2, ring_px
    inside = np.zeros((ns, nf), dtype=bool)
    discs = []
    for cs, cf in spots.centre:
        d2 = (s - cs) ** 2 + (f - cf) ** 2
        disc = d2 <= r2_spot
        discs.append((d2, disc))
        inside |= disc
    rows = []
    for (h, (cs, cf)), (d2, disc) in zip(zip(spots.hkl, spots.centre), discs):
        if not (spot_radius_px - 0.5 <= cs <= ns - 0.5 - spot_radius_px
                and spot_radius_px - 0.5 <= cf <= nf - 0.5 - spot_radius_px):
            continue
        ring = (d2 > r_in ** 2) & (d2 <= r_out ** 2) & ~inside
        n_ring, n_disc = int(ring.sum()), int(disc.sum())
        if n_ring < min_ring_pixels:
            continue
        bg = observed[ring]
        level = float(bg.mean())
        y = observed[disc]
        var = float(np.maximum(y - pedestal, 0.0).sum()) + n_disc ** 2 * float(bg.var(ddof=1)) / n_ring
        own = disc & np.all(hkl_px == np.asarray(h)[:, None, None], axis=0)
        rows.append((h, float(y.sum()) - n_disc * level, var ** 0.5, float(unit[own].sum()), level))
    if not rows:
        empty = np.zeros(0)
        return Integrated(np.zeros((0, 3), dtype=np.int64), empty, empty, empty, empty)
    hkl, inten, sig, model, level = zip(*rows)
    return Integrated(np.array(hkl, dtype=np.int64), np.array(inten), np.array(sig), np.array(model), np.array(level))
