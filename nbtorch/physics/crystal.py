"""Unit cell, reciprocal basis and crystal orientation.

Units: cell lengths in Angstrom, angles in radians, reciprocal vectors in
1/Angstrom (no 2*pi).  Bases are returned as (3, 3) tensors whose **rows** are
the vectors (row 0 = a or a*, row 1 = b or b*, row 2 = c or c*).

Default orientation (nanoBragg): a* along +x, b* in the x-y plane, c*
completing the right-handed basis.  ``-misset`` then rotates the reciprocal
vectors by ``Rz @ Ry @ Rx``.

C quirk (``c_parity=True``): nanoBragg sets ``c*_z = c* V / (a b c sin(gamma*))``
which is exact only when at most one cell angle differs from 90 degrees.  The
spec formula ``c*_z = 1 / (V a* b* sin(gamma*))`` gives a lattice with exactly
the requested cell.  Cubic, orthorhombic and monoclinic cells are identical in
both modes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _unit(v: Tensor) -> Tensor:
    return v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)


def cell_volume(a: Tensor, b: Tensor, c: Tensor, alpha: Tensor, beta: Tensor, gamma: Tensor) -> Tensor:
    """Cell volume in A^3 from lengths (A) and angles (rad), as nanoBragg computes it.

    ``V = 2abc sqrt(|sin s sin(s-alpha) sin(s-beta) sin(s-gamma)|)``, ``s`` the half angle sum.
    """
    s = 0.5 * (alpha + beta + gamma)
    skew = torch.sin(s) * torch.sin(s - alpha) * torch.sin(s - beta) * torch.sin(s - gamma)
    return 2.0 * a * b * c * torch.sqrt(torch.abs(skew))


def reciprocal_basis_from_cell(cell: Tensor, c_parity: bool = False) -> tuple[Tensor, Tensor]:
    """Reciprocal basis in the default orientation.

    Arguments:
        cell: (6,) ``a, b, c`` in A and ``alpha, beta, gamma`` in radians.
        c_parity: use the C program's ``c*_z`` formula (see module docstring).

    Returns:
        ``(recip, volume)``: recip (3, 3) rows a*, b*, c* in 1/A; volume in A^3.
    """
    a, b, c, alpha, beta, gamma = cell.unbind(-1)
    volume = cell_volume(a, b, c, alpha, beta, gamma)
    sa, sb, sg = torch.sin(alpha), torch.sin(beta), torch.sin(gamma)
    ca, cb, cg = torch.cos(alpha), torch.cos(beta), torch.cos(gamma)
    a_star = b * c * sa / volume
    b_star = c * a * sb / volume
    c_star = a * b * sg / volume
    cos_alpha_star = (cb * cg - ca) / (sb * sg)
    cos_beta_star = (cg * ca - cb) / (sg * sa)
    cos_gamma_star = (ca * cb - cg) / (sa * sb)
    sin_gamma_star = c / (volume * a_star * b_star)
    if c_parity:
        c_star_z = c_star * volume / (a * b * c * sin_gamma_star)
    else:
        c_star_z = 1.0 / (volume * a_star * b_star * sin_gamma_star)
    zero = torch.zeros_like(a_star)
    recip = torch.stack(
        (
            torch.stack((a_star, zero, zero), -1),
            torch.stack((b_star * cos_gamma_star, b_star * sin_gamma_star, zero), -1),
            torch.stack(
                (
                    c_star * cos_beta_star,
                    c_star * (cos_alpha_star - cos_beta_star * cos_gamma_star) / sin_gamma_star,
                    c_star_z,
                ),
                -1,
            ),
        ),
        -2,
    )
    return recip, volume


def crystal_real_and_reciprocal(
    cell: Tensor,
    orientation: Tensor,
    c_parity: bool = False,
) -> tuple[Tensor, Tensor]:
    """Real and reciprocal bases of an oriented crystal.

    Arguments:
        cell: (6,) lengths (A) and angles (rad).
        orientation: (3, 3) rotation applied to the default-frame reciprocal
            vectors (``misset @ U0``; ``U0`` is the identity for ``-cell`` and the
            matrix file's orientation for ``-mat``).
        c_parity: nanoBragg's triclinic ``c*_z`` formula and its reciprocal
            volume (see module docstring).

    Returns:
        ``(real, recip)``, both (3, 3) with vectors as rows; real in A, recip in 1/A.
        The real vectors have exactly the lengths ``a, b, c`` (as the C forces
        them); ``recip`` is regenerated from them as the C does (used by the
        gaussian and tophat spot shapes).
    """
    recip0, volume = reciprocal_basis_from_cell(cell, c_parity)
    recip = recip0 @ orientation.transpose(-1, -2)  # rotate each row vector
    a_s, b_s, c_s = recip.unbind(-2)
    lengths = cell[..., :3]
    real = torch.stack(
        (
            _unit(torch.linalg.cross(b_s, c_s, dim=-1)) * lengths[..., 0:1],
            _unit(torch.linalg.cross(c_s, a_s, dim=-1)) * lengths[..., 1:2],
            _unit(torch.linalg.cross(a_s, b_s, dim=-1)) * lengths[..., 2:3],
        ),
        -2,
    )
    a, b, c = real.unbind(-2)
    if c_parity:
        inv_volume = 1.0 / volume
    else:
        inv_volume = 1.0 / (a * torch.linalg.cross(b, c, dim=-1)).sum(-1)
    recip_out = torch.stack(
        (
            torch.linalg.cross(b, c, dim=-1),
            torch.linalg.cross(c, a, dim=-1),
            torch.linalg.cross(a, b, dim=-1),
        ),
        -2,
    ) * inv_volume[..., None, None]
    return real, recip_out


def cell_from_vectors(real: Tensor) -> Tensor:
    """Cell (a, b, c in A; alpha, beta, gamma in rad) of a real basis with rows a, b, c."""
    a, b, c = real.unbind(-2)
    la, lb, lc = (torch.linalg.vector_norm(v, dim=-1) for v in (a, b, c))
    alpha = torch.acos(((b * c).sum(-1) / (lb * lc)).clamp(-1.0, 1.0))
    beta = torch.acos(((a * c).sum(-1) / (la * lc)).clamp(-1.0, 1.0))
    gamma = torch.acos(((a * b).sum(-1) / (la * lb)).clamp(-1.0, 1.0))
    return torch.stack((la, lb, lc, alpha, beta, gamma), -1)


def cell_from_reciprocal(recip: Tensor) -> Tensor:
    """Cell of the lattice whose reciprocal basis has rows a*, b*, c* (1/A)."""
    return cell_from_vectors(torch.linalg.inv(recip).transpose(-1, -2))


def orientation_from_reciprocal(recip: Tensor, c_parity: bool = False) -> tuple[Tensor, Tensor]:
    """Split a reciprocal basis (rows, 1/A) into ``(cell, U)`` with recip = B(cell) U^T.

    ``U`` is the proper rotation closest to ``recip^T B^{-T}`` (polar
    decomposition), so an exactly representable matrix round-trips.
    """
    cell = cell_from_reciprocal(recip)
    b0, _ = reciprocal_basis_from_cell(cell, c_parity)
    m = recip.transpose(-1, -2) @ torch.linalg.inv(b0).transpose(-1, -2)
    u, _, vh = torch.linalg.svd(m)
    rot = u @ vh
    if torch.det(rot) < 0:
        raise ValueError("reciprocal basis is left-handed")
    return cell, rot
