"""The beam's sources: incident directions and wavelengths (divergence, dispersion, ``-sourcefile``).

nanoBragg's rules, in its order: ``-hdivrange/-hdivstep/-hdivsteps`` (and the
vertical ones, mrad) give a grid of angles, ``-round_div`` keeps those inside
the ellipse; each direction is ``-beam`` rotated about the polarization axis by
the vertical angle, then about the vertical axis ``unit(beam x polar)`` by the
horizontal one (:func:`nbtorch.physics.rotation.rotate_axis`).  ``-dispersion``
(percent, full width) and ``-dispsteps`` give each direction the wavelength
factors ``1 + k * step - dispersion/2``.  A ``-sourcefile`` replaces all of it
(missing positions: ``-source_distance`` up the beam; missing wavelengths: the
central one).  Called by :func:`nbtorch.rules.resolve.resolve_sampling`.

The widths are also canonical parameters (:mod:`nbtorch.parameters`): ``dispersion`` (percent, full width),
``divergence_h`` and ``divergence_v`` (mrad, full ranges), the values these rules resolved (0 where one
source spans the axis, and for a ``-sourcefile``).  :class:`BeamSources` keeps, beside the sources, each
source's offsets at those widths (wavelength factor - 1, and its two angles), so that the simulator moves
the sources with the widths while their number and their places in units of the width stay as resolved
(:meth:`nbtorch.simulator.Simulator.sources`, through the two tensor functions here).

Frames (as ``-hdivrange/-vdivrange``): ``beam`` is the unit propagation vector (source -> sample, lab frame),
``polar`` the unit polarization (E-vector) axis and ``vert = unit(beam x polar)``.  A source at horizontal
angle ``h`` and vertical angle ``v`` (rad) propagates along ``beam`` rotated about ``polar`` by ``v``, then
about ``vert`` by ``h`` (right-handed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nbtorch.config import SimulationConfig
from nbtorch.errors import InputError
from nbtorch.io.sources import read_sourcefile
from nbtorch.physics.rotation import rotate_axis

__all__ = ["BeamSources", "resolve_sources", "resolve_steps", "source_directions", "offset_change", "WIDTH_NAMES"]

#: the canonical names of the beam's widths, in :data:`nbtorch.parameters.TABLE` order
WIDTH_NAMES = ("dispersion", "divergence_h", "divergence_v")


@dataclass(frozen=True)
class BeamSources:
    """The resolved sources, in the C's order, and their offsets at the resolved widths.

    ``incident`` (Q, 3): unit propagation directions (source -> sample); ``wavelength_factor`` (Q,): each
    source's wavelength / the ``wavelength`` parameter; ``wavelength_offset`` (Q,): ``wavelength_factor - 1``
    as resolved (a fraction; 0 for a ``-sourcefile``); ``angles_rad`` (Q, 2): each source's horizontal angle
    (about ``unit(beam x polarization)``) and vertical angle (about the polarization axis), rad;
    ``widths``: ``dispersion`` (percent, full width), ``divergence_h`` and ``divergence_v`` (mrad, full
    ranges) as resolved, 0 where the sources have no spread along that axis.
    """

    incident: np.ndarray
    wavelength_factor: np.ndarray
    wavelength_offset: np.ndarray
    angles_rad: np.ndarray
    widths: dict


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


def resolve_sources(cfg: SimulationConfig, beam, polar, wavelength_m: float) -> BeamSources:
    """The sources of ``cfg``: incident directions (Q, 3), wavelength factors (Q,) and their offsets.

    ``beam``, ``polar``: unit propagation and polarization vectors (not parallel: the set-up checks).
    """
    if cfg.source_file is not None:
        incident, factors = _file_sources(cfg, beam, wavelength_m)
        q = len(factors)
        return BeamSources(incident, factors, np.zeros(q), np.zeros((q, 2)), dict.fromkeys(WIDTH_NAMES, 0.0))
    return _grid_sources(cfg, beam, polar, wavelength_m)


def _file_sources(cfg: SimulationConfig, beam, wavelength_m: float) -> tuple[np.ndarray, np.ndarray]:
    """Directions and wavelength factors of a ``-sourcefile``."""
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


def _grid_sources(cfg: SimulationConfig, beam, polar, wavelength_m: float) -> BeamSources:
    """The divergence grid (``-round_div`` cut) times the dispersion's wavelengths."""
    hsteps, hrange, hstep = resolve_steps(cfg.hdivsteps, _mrad(cfg.hdivrange_mrad), _mrad(cfg.hdivstep_mrad), 1.0)
    vsteps, vrange, vstep = resolve_steps(cfg.vdivsteps, _mrad(cfg.vdivrange_mrad), _mrad(cfg.vdivstep_mrad), 1.0)
    disp = None if cfg.dispersion_pct is None else cfg.dispersion_pct / 100.0
    dsteps, disp, dstep = resolve_steps(cfg.dispsteps, disp, None, 1.0)
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
    dirs, angles_rad = [], []
    if kept:  # the beam rotated about the polarization axis by vdiv, then about the vertical axis by hdiv
        angles = torch.tensor(kept, dtype=torch.float64)
        d = source_directions(torch.as_tensor(beam, dtype=torch.float64), torch.as_tensor(polar, dtype=torch.float64),
                              angles[:, 0], angles[:, 1])
        for row, pair in zip(d.numpy(), kept):
            dirs.extend([row] * dsteps)
            angles_rad.extend([pair] * dsteps)
    factors = [1.0 + dstep * j - disp / 2.0 for j in range(dsteps)]
    if min(factors) <= 0.0:
        raise InputError(f"{cfg.flag_for('dispersion_pct', '-dispersion')} {cfg.dispersion_pct:g}: the shortest of the "
                         f"{dsteps} wavelengths would be {min(factors) * wavelength_m * 1e10:g} A "
                         f"(lambda x (1 - dispersion/200)); the spectral width must be below 200%")
    lam = np.array(factors * (len(dirs) // dsteps), dtype=np.float64)
    offsets = np.array([dstep * j - disp / 2.0 for j in range(dsteps)] * (len(dirs) // dsteps), dtype=np.float64)
    widths = {"dispersion": disp * 100.0, "divergence_h": hrange * 1000.0, "divergence_v": vrange * 1000.0}
    return BeamSources(np.array(dirs, dtype=np.float64).reshape(-1, 3), lam, offsets,
                       np.array(angles_rad, dtype=np.float64).reshape(-1, 2), widths)


def _mrad(v):
    return None if v is None else v / 1000.0


def source_directions(beam: Tensor, polar: Tensor, h_rad: Tensor, v_rad: Tensor) -> Tensor:
    """Unit propagation directions (Q, 3) of sources at angles ``h_rad``, ``v_rad`` (Q,) (module docstring).

    Differentiable in the angles (and the axes); ``beam`` and ``polar`` must not be parallel.
    """
    vert = torch.linalg.cross(beam, polar, dim=-1)
    vert = vert / torch.linalg.vector_norm(vert)
    d = beam.expand(h_rad.shape[0], 3)
    d = rotate_axis(d, polar, v_rad)
    d = rotate_axis(d, vert, h_rad)
    return d / torch.linalg.vector_norm(d, dim=-1, keepdim=True)


def offset_change(offsets: Tensor, width: Tensor, width0: float) -> Tensor:
    """How offsets resolved at width ``width0`` (> 0) change at width ``width``: ``offsets * (width / width0 - 1)``.

    Written as ``offsets * ((width - width0) / width0)``: exactly 0 at ``width == width0``, so that the
    resolved values plus this change are the resolved values themselves there, to the last bit.
    """
    return offsets * ((width - width0) / width0)
