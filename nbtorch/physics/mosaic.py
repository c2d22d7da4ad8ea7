"""Mosaic domains: the rotation of each domain, isotropic or with one spread per crystal axis.

Frames and units: vectors in the lab frame (``docs/conventions.md``), angles in radians.  The domains come from
fixed draws (:func:`nbtorch.crng.mosaic_domain_draws`): a unit axis ``u_m`` (lab frame) and a fraction ``f_m`` in
[0, 1] per domain, domain 0 with ``f_0 = 0`` (the unrotated crystal).

* Isotropic (nanoBragg): domain ``m`` is the rotation by ``eta f_m`` about ``u_m`` (:func:`isotropic_mosaic_rotations`).
* Anisotropic: the spread is a symmetric tensor ``S = E^T diag(eta_a, eta_b, eta_c) E`` (lab frame) built on the
  crystal's orthonormal frame ``E`` (:func:`crystal_frame`: rows ``x`` along a, ``z`` along a x b = c*, ``y = z x x``;
  for a cell with 90-degree angles the rows are a, b, c); domain ``m`` is the rotation by the rotation vector
  ``omega_m = f_m S u_m`` (:func:`anisotropic_mosaic_rotations`).  Rotations about the crystal's x axis are scaled
  by ``eta_a``, about y by ``eta_b``, about z by ``eta_c``.  With ``eta_a = eta_b = eta_c = eta``, ``S = eta I`` and
  every domain is the isotropic one (to rounding); each domain is a smooth function of the three spreads and of
  the cell and orientation (through ``E``).  With phi steps the tensor turns with the crystal:
  ``S_phi = R_phi S R_phi^T``, ``U_m(phi) = exp([f_m S_phi u_m]x)``, and the crystal of domain ``m`` at step phi is
  ``U_m(phi) R_phi`` (the isotropic model: ``U_m R_phi``), so equal spreads give the isotropic domains at every phi.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nbtorch.physics.rotation import rotation_matrix_axis_angle, rotation_matrix_from_vector


def crystal_frame(real: Tensor) -> Tensor:
    """The crystal's orthonormal frame (3, 3), rows ``x = a/|a|``, ``y = z x x``, ``z = (a x b)/|a x b|`` (lab
    frame) from the real-space vectors ``real`` (3, 3) (rows a, b, c, Angstrom)."""
    a, b = real[0], real[1]
    x = a / torch.linalg.vector_norm(a)
    n = torch.linalg.cross(a, b)
    z = n / torch.linalg.vector_norm(n)
    y = torch.linalg.cross(z, x)
    return torch.stack((x, y, z))


def isotropic_mosaic_rotations(axes: Tensor, fractions: Tensor, spread_rad: Tensor) -> Tensor:
    """nanoBragg's domains (M, 3, 3): rotation by ``spread_rad * fractions`` (M,) about ``axes`` (M, 3) (lab)."""
    return rotation_matrix_axis_angle(axes, spread_rad * fractions)


def anisotropic_mosaic_rotations(axes: Tensor, fractions: Tensor, spreads_rad: Tensor, frame: Tensor,
                                 r_phi: Tensor) -> Tensor:
    """The anisotropic domains (Φ, M, 3, 3) (module docstring): ``exp([f_m R_phi S R_phi^T u_m]x)``.

    Arguments:
        axes: (M, 3) unit axes ``u_m`` of the draws (lab frame).
        fractions: (M,) ``f_m`` (0 for domain 0).
        spreads_rad: (3,) ``eta_a, eta_b, eta_c`` (radians, >= 0) about the frame's x, y, z.
        frame: (3, 3) the crystal's orthonormal frame at phi 0 (:func:`crystal_frame`, rows x, y, z, lab).
        r_phi: (Φ, 3, 3) the spindle rotation of each phi step.
    """
    spread_lab = frame.transpose(-1, -2) @ (spreads_rad[:, None] * frame)  # S = E^T diag(eta) E
    s_phi = r_phi @ spread_lab @ r_phi.transpose(-1, -2)  # (Φ, 3, 3)
    omega = fractions[None, :, None] * torch.einsum("pij,mj->pmi", s_phi, axes)  # (Φ, M, 3)
    return rotation_matrix_from_vector(omega)
