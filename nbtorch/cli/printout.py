"""Per-pixel diagnostics for the command line: ``-printout``, ``-printout_pixel`` and the
"solid angle subtended by detector" statistic.

The C program prints, inside its pixel loop, the quantities it last touched for a
pixel.  :func:`pixel_reports` recomputes them for chosen pixels from the
Simulator's public pieces (``parameters_dict``, ``geometry``, ``crystal``) and the
pure functions of :mod:`nbtorch.physics`; the image itself always comes from
``Simulator.render`` (this module never produces pixel values).

What each printed quantity is (C loop order: layer, sub-pixel, source, phi, mosaic):

* ``stol``: sin(theta)/lambda of the last evaluation, in 1/Angstrom, "or" the value
  at the last sub-pixel position for the nominal wavelength (the C prints the first in
  1/m and the second in 1/A; both are 1/A here);
* ``at``: the last sub-pixel position (m); ``hkl``/``hkl0``/``F_cell``/``F_latt``: the
  last evaluation (last layer, sub-pixel, source, phi step and mosaic domain);
* ``I``: ``I_bg + sum F_cell^2 F_latt^2`` over every evaluation of the pixel (no
  ``-oversample_*`` running-sum compounding; structure factors as the spec lookup:
  the C-parity interpolation switch-off is not replayed);
* ``polar``: at the first sub-pixel and the first source not cut by ``-dmin``;
  ``omega``: at the first sub-pixel; ``capfrac``: of the last layer at its first
  sub-pixel (the C's cached values);
* ``pixel``: the rendered value;
* real-space vectors: last phi step and mosaic domain, in Angstrom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from nbtorch.physics.detector import subpixel_positions
from nbtorch.physics.kernel import R_E_SQR
from nbtorch.parameters import SIZE_DIAGONAL, SIZE_OFF_DIAGONAL
from nbtorch.physics.lattice import lattice_factor, nearest_index, size_vector
from nbtorch.physics.polarization import kahn_polarization
from nbtorch.physics.structure import structure_factor

__all__ = ["pixel_reports", "solid_angle_sum", "format_report"]


def _tensor_fn(sim):
    return lambda value: torch.as_tensor(value, dtype=sim.dtype, device=sim.device)


def _positions(sim, geom, fast: torch.Tensor, slow: torch.Tensor) -> torch.Tensor:
    s, cfg = sim.setup, sim.config
    t = _tensor_fn(sim)
    layers = torch.arange(s.thicksteps, dtype=sim.dtype, device=sim.device) * t(s.layer_thickness_m)
    return subpixel_positions(geom, fast, slow, t(s.pixel_m), s.oversample, layers,
                              curved=cfg.curved_det, c_parity=s.c_parity)


def _omega(sim, geom, pos: torch.Tensor) -> torch.Tensor:
    """Solid angle (sr) of each sub-pixel position (..., 3), as the image uses it."""
    s, cfg = sim.setup, sim.config
    R = torch.linalg.vector_norm(pos, dim=-1)
    if cfg.point_pixel:
        return 1.0 / (R * R)
    area = s.pixel_m**2 / (R * R)
    if s.c_parity:
        return area * geom.close_distance / R
    if cfg.curved_det:
        return area
    return area * torch.abs((pos / R[..., None] * geom.odet).sum(-1))


def distances_summary(sim) -> str:
    """One line naming both detector distances (mm) of the resolved geometry, and which one the user gave.

    ``close_distance``: sample to the detector plane along its normal (``-close_distance``);
    ``distance``: sample to the detector plane along the beam (``-distance``, the canonical parameter).
    The one set by ``-close_distance`` (or an ``-img`` header's CLOSE_DISTANCE) is marked ``(given)``,
    else ``distance`` is.
    """
    with torch.no_grad():
        g = sim.geometry(sim.parameters_dict())
        close_mm, dist_mm = float(g.close_distance) * 1000.0, float(g.distance) * 1000.0
    close_given = sim.config.close_distance_mm is not None
    return (f"detector distances: close_distance {close_mm:g} mm ({'given; ' if close_given else ''}sample to the "
            f"detector plane along its normal), distance {dist_mm:g} mm ({'' if close_given else 'given; '}sample "
            f"to the detector plane along the beam)")


def solid_angle_sum(sim, mask: np.ndarray | None = None, chunk: int = 1 << 16) -> float:
    """The "solid angle subtended by detector" (sr) over the rendered pixels.

    Spec: the sum over pixels of their solid angle (mean over sub-pixels, front layer).
    C parity: the C's ``omega_sum/steps``, which sums the cached per-pixel omega over
    every layer and sub-pixel and divides by sources x phi x mosaic x oversample^2.
    ``mask`` (spixels, fpixels) True = simulated; other pixels are not counted.
    """
    s, cfg = sim.setup, sim.config
    x0, x1, y0, y1 = s.roi
    ss, ff = np.meshgrid(np.arange(y0, y1 + 1), np.arange(x0, x1 + 1), indexing="ij")
    ss, ff = ss.ravel(), ff.ravel()
    if mask is not None:
        keep = mask[ss, ff]
        ss, ff = ss[keep], ff[keep]
    total = 0.0
    with torch.no_grad():
        p = sim.parameters_dict()
        geom = sim.geometry(p)
        for start in range(0, ss.size, chunk):
            sl = torch.as_tensor(ss[start:start + chunk], device=sim.device)
            fa = torch.as_tensor(ff[start:start + chunk], device=sim.device)
            omega = _omega(sim, geom, _positions(sim, geom, fa, sl))  # (P, T, S)
            if s.c_parity:
                if not cfg.oversample_omega:
                    omega = omega[:, :1, :1].expand_as(omega)
                total += float(omega.sum()) / s.steps
            else:
                total += float(omega[:, 0].mean(-1).sum())
    return total


def pixel_reports(sim, pixels: Iterable[tuple[int, int]], image: np.ndarray, chunk: int | None = None) -> list[dict]:
    """The C's printout quantities for each ``(fast, slow)`` pixel (see the module docstring).

    ``image`` is the rendered (slow, fast) image the ``pixel`` values come from.
    """
    s = sim.setup
    pixels = list(pixels)
    if not pixels:
        return []
    per_pixel = max(1, s.evaluations_per_pixel)
    chunk = chunk or max(1, getattr(sim, "max_evals_per_tile", 1 << 20) // per_pixel)
    out: list[dict] = []
    with torch.no_grad():
        model = _printout_model(sim)
        for start in range(0, len(pixels), chunk):
            part = pixels[start:start + chunk]
            out += _chunk_reports(sim, model, part, _chunk_terms(sim, model, part), image)
    return out


@dataclass(frozen=True)
class _Shared:
    """What every pixel's printout shares (tensors on the simulator's device)."""

    p: dict
    geom: object
    real_A: torch.Tensor
    recip: torch.Tensor
    F_grid: torch.Tensor | None
    hkl_min: torch.Tensor | None
    hkl_max: torch.Tensor | None
    n_cells: torch.Tensor
    incident: torch.Tensor
    lam: torch.Tensor
    I_bg: float
    last_vectors: np.ndarray


@dataclass(frozen=True)
class _ChunkTerms:
    """The printout's tensors for a chunk of pixels (P first)."""

    pos: torch.Tensor
    stol: torch.Tensor
    hkl: torch.Tensor
    hkl0: torch.Tensor
    f_cell: torch.Tensor
    f_latt: torch.Tensor
    I: torch.Tensor  # noqa: E741
    polar0: torch.Tensor
    omega0: torch.Tensor
    capture: torch.Tensor


def _printout_model(sim) -> _Shared:
    """What every pixel's printout shares: parameters, geometry, crystal, structure factors, sources."""
    s = sim.setup
    t = _tensor_fn(sim)
    p = sim.parameters_dict()
    geom = sim.geometry(p)
    real_A, recip = sim.crystal(p)  # (Φ, M, 3, 3), (3, 3)
    incident, lam = sim.sources(p)
    return _Shared(
        p=p, geom=geom, real_A=real_A, recip=recip,
        F_grid=None if s.F_grid is None else t(s.F_grid),
        hkl_min=None if s.hkl_min is None else t(s.hkl_min),
        hkl_max=None if s.hkl_max is None else t(s.hkl_max),
        n_cells=size_vector([p[n] for n in SIZE_DIAGONAL], [p[n] for n in SIZE_OFF_DIAGONAL], s.shape),
        incident=incident,
        lam=lam,
        I_bg=float(R_E_SQR * p["fluence"] * s.water_F2N) if s.water_F2N > 0 else 0.0,
        last_vectors=real_A[-1, -1].double().cpu().numpy(),  # rows a, b, c (A)
    )


def _chunk_terms(sim, m: _Shared, part: list[tuple[int, int]]) -> _ChunkTerms:
    """The printout's tensors for the pixels ``part``: positions, stol, hkl, F, I, polar, omega, capture."""
    s, cfg = sim.setup, sim.config
    t = _tensor_fn(sim)
    fa = torch.tensor([f for f, _ in part], device=sim.device)
    sl = torch.tensor([q for _, q in part], device=sim.device)
    pos = _positions(sim, m.geom, fa, sl)  # (P, T, S, 3)
    R = torch.linalg.vector_norm(pos, dim=-1)
    diffracted = pos / R[..., None]
    scatter = (diffracted[..., None, :] - m.incident) / m.lam[:, None]  # (P, T, S, Q, 3)
    stol = 0.5 * torch.linalg.vector_norm(scatter, dim=-1)  # (P, T, S, Q)
    if s.dmin_A > 0:
        valid = ~((stol > 0) & (s.dmin_A * stol > 0.5))
    else:
        valid = torch.ones_like(stol, dtype=torch.bool)
    hkl = torch.einsum("ptsqc,fmrc->ptsqfmr", scatter, m.real_A)  # (P, T, S, Q, Φ, M, 3)
    hkl0 = nearest_index(hkl)
    f_latt = lattice_factor(hkl, hkl0, m.n_cells, s.shape, m.recip, s.fudge)
    f_cell = structure_factor(hkl, hkl0, m.F_grid, m.hkl_min, m.hkl_max, m.p["default_F"], s.interpolate)
    term = torch.where(valid[..., None, None], (f_cell * f_latt) ** 2, torch.zeros_like(f_latt))
    I = m.I_bg + term.flatten(1).sum(1)  # (P,)
    if cfg.nopolar:
        polar0 = torch.ones(len(part), dtype=sim.dtype, device=sim.device)
    else:
        polar = kahn_polarization(m.incident, diffracted[:, 0, 0, None, :], t(s.polar_axis), m.p["polarization"])
        v0 = valid[:, 0, 0]  # (P, Q)
        q0 = torch.argmax(v0.to(torch.int8), dim=1)
        polar0 = torch.where(v0.any(1), polar.gather(1, q0[:, None])[:, 0], torch.zeros_like(q0, dtype=sim.dtype))
    omega0 = _omega(sim, m.geom, pos[:, 0, 0])
    if s.has_thickness:
        parallax = (diffracted[:, -1, 0] * m.geom.odet).sum(-1)
        k = s.thicksteps - 1
        dz = s.layer_thickness_m * s.mu_per_m / parallax
        capture = torch.exp(-k * dz) - torch.exp(-(k + 1.0) * dz)
    else:
        capture = torch.ones(len(part), dtype=sim.dtype, device=sim.device)
    return _ChunkTerms(pos=pos, stol=stol, hkl=hkl, hkl0=hkl0, f_cell=f_cell, f_latt=f_latt, I=I, polar0=polar0,
                           omega0=omega0, capture=capture)


def _chunk_reports(sim, m: _Shared, part: list[tuple[int, int]], q: _ChunkTerms,
                   image: np.ndarray) -> list[dict]:
    """One report dict per pixel of ``part`` from its chunk's tensors ``q``."""
    s = sim.setup
    lam0 = float(m.p["wavelength"])
    out = []
    for j, (f, sp) in enumerate(part):
        last_pos = q.pos[j, -1, -1].double().cpu().numpy()
        # the C's atan2(|(y, z)|, x) is this angle for its beam along +x
        cos2t = float(np.dot(last_pos, s.beam) / np.linalg.norm(last_pos))
        twotheta = math.acos(max(-1.0, min(1.0, cos2t)))
        out.append({
            "fpixel": f, "spixel": sp,
            "stol": float(q.stol[j, -1, -1, -1]),
            "stol_nominal": math.sin(twotheta / 2.0) / lam0,
            "position_m": last_pos,
            "hkl": q.hkl[j, -1, -1, -1, -1, -1].double().cpu().numpy(),
            "hkl0": q.hkl0[j, -1, -1, -1, -1, -1].double().cpu().numpy().astype(int),
            "F_cell": float(q.f_cell[j, -1, -1, -1, -1, -1]),
            "F_latt": float(q.f_latt[j, -1, -1, -1, -1, -1]),
            "I": float(q.I[j]),
            "I_per_step": float(q.I[j]) / s.steps,
            "polar": float(q.polar0[j]),
            "omega": float(q.omega0[j]),
            "capfrac": float(q.capture[j]),
            "pixel": float(image[sp, f]),
            "real_vectors_A": m.last_vectors,
        })
    return out


def format_report(r: dict) -> str:
    """One pixel's report in the C's printout layout."""
    x, y, z = r["position_m"]
    h, k, l = r["hkl"]  # noqa: E741
    h0, k0, l0 = r["hkl0"]
    a = r["real_vectors_A"]
    lines = [
        "%4d %4d : stol = %g or %g" % (r["fpixel"], r["spixel"], r["stol"], r["stol_nominal"]),
        "at %g %g %g" % (x, y, z),
        "hkl= %f %f %f  hkl0= %d %d %d" % (h, k, l, h0, k0, l0),
        " F_cell=%g  F_latt=%g   I = %g" % (r["F_cell"], r["F_latt"], r["I"]),
        "I/steps %15.10g" % r["I_per_step"],
        "polar   %15.10g" % r["polar"],
        "omega   %15.10g" % r["omega"],
        "capfrac %15.10g" % r["capfrac"],
        "pixel   %15.10g" % r["pixel"],
        "real-space cell vectors (Angstrom):",
        "     %-10s  %-10s  %-10s" % ("a", "b", "c"),
    ]
    for i, axis in enumerate("XYZ"):
        lines.append("%s: %11.8f %11.8f %11.8f" % (axis, a[0, i], a[1, i], a[2, i]))
    return "\n".join(lines)


def roi_pixels(roi: Sequence[int], mask: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(fast, slow) of every pixel in the ROI, slow-major (the C's order), skipping masked ones."""
    x0, x1, y0, y1 = roi
    return [(f, q) for q in range(y0, y1 + 1) for f in range(x0, x1 + 1) if mask is None or mask[q, f]]
