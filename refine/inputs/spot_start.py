"""A rotation sweep's start from its indexed spots: the cell and orientation fitted to the observed centroids before
the pixels are (``nbtorch-refine --images ... --expt --refl --rotation-series``; docs/sweep-from-dials.md).

The pixels of a 0.1 deg image see a reflection only within a fraction of a degree of its rocking angle and a few
pixels of its position: from a cell 1 % off, a reflection at 800 pixels from the beam is 8 pixels away and rocks
half a degree off, outside the fitted windows and outside the wedge, and the pixel loss has no gradient to follow.
The indexed spots of DIALS's ``.refl`` (``miller_index``, the observed ``x, y`` and frame ``z``) do not have that
limit: :func:`align_to_spots` moves the refined names (default the cell and the orientation) so that every spot's
predicted position at its observed angle matches its observed position and its predicted rocking angle its observed
frame, as DIALS's own refinement does, with a Huber loss (1 pixel, 1 frame: a few outliers do not pull), and the pixel
refinement starts from there.

Predictions are analytic (:func:`predict`): ``S = R(spindle, phi) h B U`` (the simulator's reciprocal vectors at phi
0), the ray ``s0 + S`` meets the detector plane at the position; its excitation error ``|s0 + S| - 1/lambda`` over
``|S|`` is the angle to the Ewald sphere of a reflection crossing it squarely (in frames of the scan); where the
rotation hardly moves a reflection through the sphere (near the spindle) the angle is poorly defined and the
residual is smaller, as DIALS weights such reflections' angles less.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from nbtorch.parameters import SIMULATOR_NAMES
from nbtorch.geometry.rotation import rotation_matrix_axis_angle
from refine.fitting.parameters import ParameterMap, ParameterSpace

__all__ = ["predict", "align_to_spots", "SpotAlignment", "HUBER"]

log = logging.getLogger(__name__)

#: where the Huber loss of the spot residuals turns linear (pixels, frames)
HUBER = 1.0


def predict(sim, values: Mapping[str, Tensor | float], hkl: Tensor, phi_deg: Tensor, osc_deg: float) -> Tensor:
    """``(n, 3)``: each reflection's predicted ``(x, y)`` pixel position (centres at ``i + 0.5``) at its angle
    ``phi_deg`` and its excitation error as an angle in frames of ``osc_deg`` (module docstring; differentiable in
    ``values``)."""
    p = sim.parameters_dict(**{k: v for k, v in values.items() if k in SIMULATOR_NAMES})
    geom = sim.geometry(p)
    _, recip = sim.crystal_vectors(p)
    spindle = torch.as_tensor(sim.setup.spindle, dtype=recip.dtype)
    rot = rotation_matrix_axis_angle(spindle.expand(len(hkl), 3), phi_deg * (math.pi / 180.0))
    s = torch.einsum("nij,nj->ni", rot, hkl.to(recip.dtype) @ recip)
    s0 = geom.beam / p["wavelength"]
    d = s0 + s
    # the excitation error over |S|: the angle to the sphere of a reflection that crosses it squarely, less where the
    # rotation hardly moves the reflection through the sphere (near the spindle), whose angle is poorly defined
    dphi = -(torch.linalg.vector_norm(d, dim=-1) - 1.0 / p["wavelength"]) / torch.linalg.vector_norm(s, dim=-1)
    t = (geom.pix0 * geom.odet).sum() / (d * geom.odet).sum(-1)
    rel = t[:, None] * d - geom.pix0
    basis = torch.stack([geom.fdet, geom.sdet, geom.odet], dim=1)
    fs = torch.linalg.solve(basis, rel.T).T[:, :2] / sim.setup.pixel_m
    return torch.cat([fs, (dphi / math.radians(osc_deg))[:, None]], dim=1)


@dataclass(frozen=True)
class SpotAlignment:
    """What :func:`align_to_spots` did: the refined names' values, and the rms of the position residuals (px) and of
    the angle residuals (frames) at the start and at the end, over ``n`` spots."""

    values: dict
    n: int
    rms_px_start: float
    rms_px_final: float
    rms_frames_start: float
    rms_frames_final: float


def _rms(r: Tensor) -> tuple[float, float]:
    return float(torch.sqrt((r[:, :2] ** 2).sum(1).mean())), float(torch.sqrt((r[:, 2] ** 2).mean()))


def align_to_spots(sim, start: Mapping[str, float], hkl: np.ndarray, xyz: np.ndarray, phi_deg: np.ndarray,
                   osc_deg: float, symmetry: str = "triclinic", names: Sequence[str] = ("cell", "orientation"),
                   max_iter: int = 200) -> SpotAlignment:
    """Fit ``names`` (groups or names of :mod:`refine.fitting.parameters`) so that the indexed spots ``hkl`` (n, 3),
    observed at ``xyz`` (n, 3: x, y px and z frames) and angles ``phi_deg`` (n,), are predicted where they are seen
    (:func:`predict`, Huber loss): ``start`` (every base value) with the fitted names replaced."""
    space = ParameterSpace(symmetry=symmetry, pixel_mm=float(sim.setup.pixel_m) * 1000.0)
    pmap = ParameterMap(space, dict(start), space.expand(tuple(names)))
    dtype = torch.float64
    hkl_t, phi = torch.as_tensor(np.asarray(hkl), dtype=dtype), torch.as_tensor(np.asarray(phi_deg), dtype=dtype)
    observed = torch.as_tensor(np.c_[np.asarray(xyz)[:, :2], np.zeros(len(xyz))], dtype=dtype)

    def residuals(raw: Tensor) -> Tensor:
        return predict(sim, pmap.expand(pmap.physical(raw)), hkl_t, phi, osc_deg) - observed

    raw = pmap.raw0(dtype).clone().requires_grad_(True)
    with torch.no_grad():
        first = _rms(residuals(raw))
    opt = torch.optim.LBFGS([raw], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.huber_loss(residuals(raw), torch.zeros_like(observed), reduction="sum", delta=HUBER)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        last = _rms(residuals(raw))
    values = pmap.values_at(raw.detach())
    log.info("spot alignment: %d spots, rms %.3g px, %.3g frames -> %.3g px, %.3g frames", len(hkl), *first, *last)
    return SpotAlignment(values=values, n=len(hkl), rms_px_start=first[0], rms_px_final=last[0],
                         rms_frames_start=first[1], rms_frames_final=last[1])
