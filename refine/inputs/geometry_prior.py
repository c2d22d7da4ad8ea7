"""DIALS's detector geometry as a measurement: its values with the esds its indexed spots give them (the prior of a
rotation series from DIALS files; ``nbtorch-refine --expt --refl --rotation-series``, docs/sweep-from-dials.md).

DIALS refines the distance and beam centre from the centroids of its indexed spots, with the cell and orientation.
On a narrow wedge the distance and the cell are nearly one parameter, so DIALS's distance is as uncertain as the
cell it came with; from a whole sweep it is well known.  Held at DIALS's value, the distance leaves its uncertainty
out of the cell's esds; refined without a prior, it trades freely against the cell on a wedge.  Here it is what it
is: a measurement, with an esd.

The esd (:func:`spot_geometry_prior`): the centroid fit DIALS made, repeated on the ``.refl``'s indexed spots at the
starting model (:func:`refine.inputs.spot_start.predict`: each spot's ``x, y`` in pixels and its angle to the Ewald
sphere in frames): the Jacobian ``J`` of the residuals with respect to the cell, the orientation and the geometry
names, each coordinate weighted by the scatter of its own residuals (``s_xy`` pooled over ``x`` and ``y``, ``s_z``;
the degrees of freedom counted; at least :data:`MIN_SCATTER`), ``C = (J' W J)^-1``, and each geometry name's marginal esd ``sqrt(C_kk)``: the
cell's and orientation's uncertainty is in it.  The spots of the whole ``.refl`` count, also those of images not
given to the run: from a whole sweep the prior is narrow, from a wedge as wide as the wedge allows.  A name the spots
do not determine (an infinite esd) gets no prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from refine.fitting.parameters import ParameterMap, ParameterSpace
from refine.inputs.spot_start import predict
from refine.quality.uncertainty import pseudo_inverse
from refine.solver.precondition import physical_per_raw

__all__ = ["GeometryPrior", "spot_geometry_prior", "GEOMETRY_NAMES", "MIN_SCATTER"]

#: the detector names whose DIALS values enter as a prior by default (distance in mm, beam centre in mm)
GEOMETRY_NAMES = ("distance", "beam_x", "beam_y")
#: the least scatter of a centroid coordinate the prior assumes (pixels; frames): a spot finder's centroid is not
#: known better than a tenth of a pixel or a frame, however well a few spots happen to fit
MIN_SCATTER = 0.1


@dataclass(frozen=True)
class GeometryPrior:
    """The geometry's priors ``name -> (DIALS's value, esd)`` (own units; names without an esd left out), the spots
    they came from and the scatter of their residuals the esds assume (px, frames)."""

    priors: dict
    n_spots: int
    scatter_px: float
    scatter_frames: float


def spot_geometry_prior(sim, values: Mapping[str, float], hkl: np.ndarray, xyz: np.ndarray, phi_deg: np.ndarray,
                        osc_deg: float, symmetry: str, names: Sequence[str] = GEOMETRY_NAMES) -> GeometryPrior:
    """The priors of ``names`` at ``values`` (every base value: DIALS's geometry, the cell and orientation the spots
    give) from the indexed spots ``hkl`` (n, 3) seen at ``xyz`` (n, 3: x, y px, z frames) and angles ``phi_deg``
    (module docstring)."""
    space = ParameterSpace(symmetry=symmetry, pixel_mm=float(sim.setup.pixel_m) * 1000.0)
    fitted = space.expand(("cell", "orientation")) + tuple(names)
    pmap = ParameterMap(space, dict(values), fitted)
    dtype = torch.float64
    hkl_t, phi = torch.as_tensor(np.asarray(hkl), dtype=dtype), torch.as_tensor(np.asarray(phi_deg), dtype=dtype)
    observed = torch.as_tensor(np.c_[np.asarray(xyz)[:, :2], np.zeros(len(xyz))], dtype=dtype)
    raw0 = pmap.raw0(dtype)

    def residuals(raw: torch.Tensor) -> torch.Tensor:
        return predict(sim, pmap.expand(pmap.physical(raw)), hkl_t, phi, osc_deg) - observed

    with torch.no_grad():
        r = residuals(raw0)
    n, p = len(hkl_t), len(fitted)
    if 3 * n <= p or not bool(torch.isfinite(r).all()):  # no degrees of freedom left, or no prediction
        return GeometryPrior({}, n, math.nan, math.nan)
    scale = math.sqrt(3 * n / (3 * n - p))
    s_xy = max(math.sqrt(float((r[:, :2] ** 2).mean())) * scale, MIN_SCATTER)
    s_z = max(math.sqrt(float((r[:, 2] ** 2).mean())) * scale, MIN_SCATTER)
    J = torch.autograd.functional.jacobian(residuals, raw0)  # (n, 3, p)
    w = torch.tensor([1 / s_xy, 1 / s_xy, 1 / s_z], dtype=dtype)
    Jw = (J * w[None, :, None]).reshape(3 * n, p)
    C, blind, _ = pseudo_inverse(Jw.T @ Jw)
    d = physical_per_raw(pmap, raw0)
    priors = {}
    for name in names:
        k = fitted.index(name)
        esd = float(d[k]) * math.sqrt(max(float(C[k, k]), 0.0)) if not bool(blind[k]) else math.inf
        if math.isfinite(esd) and esd > 0:
            priors[name] = (float(values[name]), esd)
    return GeometryPrior(priors, n, s_xy, s_z)
