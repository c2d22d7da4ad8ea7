"""The beam's sources: incident directions and wavelengths (divergence, dispersion, ``-sourcefile``).

nanoBragg's rules, in its order: ``-hdivrange/-hdivstep/-hdivsteps`` (and the
vertical ones, mrad) give a grid of angles, ``-round_div`` keeps those inside
the ellipse; each direction is ``-beam`` rotated about the polarization axis by
the vertical angle, then about the vertical axis ``unit(beam x polar)`` by the
horizontal one (:func:`nbtorch.physics.rotation.rotate_axis`).  ``-dispersion``
(percent, full width) and ``-dispsteps`` give each direction the wavelength
factors ``1 + k * step - dispersion/2``.  A ``-sourcefile`` replaces all of it
(missing positions: ``-source_distance`` up the beam; missing wavelengths: the
central one).  Called by :func:`nbtorch.resolve.resolve_sampling`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nbtorch.config import SimulationConfig
from nbtorch.errors import InputError
from nbtorch.io.sources import read_sourcefile
from nbtorch.physics.rotation import rotate_axis

__all__ = ["resolve_sources", "resolve_steps"]


def resolve_steps(count, range_, step, count_only_range: float):
    """The C's count/range/step auto-resolution (divergence and dispersion)."""
    count = -1 if count is None else count
    range_ = -1.0 if range_ is None else range_
    step = -1.0 if step is None else step
    if count <= 0:
        if range_ < 0.0:
            if step <= 0.0:
                count, range_, step = 1, 0.0, 0.0
            else:
                range_, count = step, 2
        elif step <= 0.0:
            step, count = range_, 2
        else:
            count = math.ceil(range_ / step)
    else:
        if range_ < 0.0:
            if step <= 0.0:
                range_ = count_only_range
                step = range_ / count
            else:
                range_, count = step, 2
        elif step <= 0.0:
            if count <= 1:
                count = 2
            step = range_ / (count - 1)
    if range_ <= 0.0 or step <= 0.0 or count <= 0:
        count, range_, step = 1, 0.0, 0.0
    return count, range_, step


def resolve_sources(cfg: SimulationConfig, beam, polar, wavelength_m: float) -> tuple[np.ndarray, np.ndarray]:
    """Incident directions (Q, 3) and wavelength factors (Q,), in the C's order.

    ``beam``, ``polar``: unit propagation and polarization vectors (not parallel: the set-up checks).
    """
    if cfg.source_file is not None:
        table = np.array(read_sourcefile(cfg.source_file), dtype=np.float64)
        dist_m = cfg.source_distance_mm / 1000.0
        xyz = table[:, :3].copy()
        for j in range(3):
            xyz[:, j] = np.where(np.isnan(xyz[:, j]), -dist_m * beam[j], xyz[:, j])
        lam = np.where(np.isnan(table[:, 4]), wavelength_m, table[:, 4])
        norms = np.linalg.norm(xyz, axis=1)
        if np.any(norms == 0) or np.any(lam <= 0):
            raise InputError(f"{cfg.source_file}: a source has zero position vector or non-positive wavelength")
        return -(xyz / norms[:, None]), lam / wavelength_m
    hsteps, hrange, hstep = resolve_steps(cfg.hdivsteps, _mrad(cfg.hdivrange_mrad), _mrad(cfg.hdivstep_mrad), 1.0)
    vsteps, vrange, vstep = resolve_steps(cfg.vdivsteps, _mrad(cfg.vdivrange_mrad), _mrad(cfg.vdivstep_mrad), 1.0)
    disp = None if cfg.dispersion_pct is None else cfg.dispersion_pct / 100.0
    dsteps, disp, dstep = resolve_steps(cfg.dispsteps, disp, None, 1.0)
    vert = np.cross(beam, polar)
    vert = vert / np.linalg.norm(vert)  # the vertical axis, unit(beam x polar)
    kept = []  # (hdiv, vdiv) in rad of the sources inside the divergence cut, in the C's order
    for ih in range(hsteps):
        for iv in range(vsteps):
            hdiv = hstep * ih - hrange / 2.0
            vdiv = vstep * iv - vrange / 2.0
            if cfg.round_div:
                test = (hdiv * hdiv - hstep * hstep / 4.0 * (1 - hsteps % 2)) / hrange / hrange if hrange else 0.0
                test += (vdiv * vdiv - vstep * vstep / 4.0 * (1 - vsteps % 2)) / vrange / vrange if vrange else 0.0
                if test * 4.0 > 1.1:
                    continue
            kept.append((hdiv, vdiv))
    dirs = []
    if kept:  # -beam rotated about the polarization axis by vdiv, then about the vertical axis by hdiv
        angles = torch.tensor(kept, dtype=torch.float64)
        v = torch.as_tensor(-beam).expand(len(kept), 3)
        v = rotate_axis(v, torch.as_tensor(polar), angles[:, 1])
        v = rotate_axis(v, torch.as_tensor(vert), angles[:, 0])
        for row in v.numpy():
            dirs.extend([-(row / np.linalg.norm(row))] * dsteps)
    factors = [1.0 + dstep * j - disp / 2.0 for j in range(dsteps)]
    if min(factors) <= 0.0:
        raise InputError(f"{cfg.flag_for('dispersion_pct', '-dispersion')} {cfg.dispersion_pct:g}: the shortest of the "
                         f"{dsteps} wavelengths would be {min(factors) * wavelength_m * 1e10:g} A "
                         f"(lambda x (1 - dispersion/200)); the spectral width must be below 200%")
    lam = np.array(factors * (len(dirs) // dsteps), dtype=np.float64)
    return np.array(dirs, dtype=np.float64).reshape(-1, 3), lam


def _mrad(v):
    return None if v is None else v / 1000.0
