"""Mosaic domains: the rotation of each domain, isotropic or with one spread per crystal axis.

Frames and units: vectors in the lab frame (``docs/conventions.md``), angles in radians.  Each domain is a unit
axis ``u_m`` (lab frame) and a fraction ``f_m >= 0`` (its angle in spreads), fixed numbers of the model: an even,
deterministic set (:func:`even_mosaic_domains`: ``ball``, the C's law and spec mode's default, or ``gaussian``) or the
C program's random draw (:func:`nbtorch.sampling.crng.mosaic_domain_draws`, domain 0 the unrotated crystal); every domain
weighs the same.

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

import math

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


# --- the mosaic domain sets -------------------------------------------------------------------------------------------
#: the mosaic models (``-mosaic_model``): ``gaussian`` and ``ball`` are even, deterministic sets of domains
#: (:func:`even_mosaic_domains`); ``random`` is the C program's random draw (:mod:`nbtorch.sampling.crng`).
MOSAIC_MODELS = ("gaussian", "ball", "random")
#: the models whose domains are an even, deterministic set
EVEN_MOSAIC_MODELS = ("gaussian", "ball")
_GOLDEN_ANGLE = math.pi * (3.0 - math.sqrt(5.0))
#: E[f^2] of the C's angle fraction ``f = (1 - r^2)^(1/3)``, r uniform in -1..1: ``B(1/2, 5/3) / 2``
_BALL_MEAN_F2 = 0.5 * math.exp(math.lgamma(0.5) + math.lgamma(5.0 / 3.0) - math.lgamma(13.0 / 6.0))


def rocking_sigma_per_spread(model: str) -> float:
    """The rms rocking angle about any fixed axis (a reflection's rocking-curve sigma from the mosaic alone) per unit
    ``mosaic_spread`` of ``model``: 1 for ``gaussian`` (the spread *is* that sigma, as DIALS' ``sigma_m``);
    ``sqrt(E[f^2] / 3)`` = 0.4964 for ``ball`` and ``random`` (the spread is the C's largest angle)."""
    if model == "gaussian":
        return 1.0
    if model in ("ball", "random"):
        return math.sqrt(_BALL_MEAN_F2 / 3.0)
    raise ValueError(f"unknown mosaic model {model!r} (expected one of {', '.join(MOSAIC_MODELS)})")


def _chi3_quantile(p: float) -> float:
    """The radius r with P(|z| <= r) = p for a standard normal 3-vector z (the Maxwell law), by bisection."""
    def cdf(r: float) -> float:
        return math.erf(r / math.sqrt(2.0)) - math.sqrt(2.0 / math.pi) * r * math.exp(-0.5 * r * r)

    lo, hi = 0.0, 12.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def _radius_quantile(model: str, p: float) -> float:
    """The rotation angle (in spreads) below which a fraction ``p`` of the model's domains lie."""
    if model == "gaussian":
        return _chi3_quantile(p)
    return (1.0 - (1.0 - p) ** 2) ** (1.0 / 3.0)  # the C's f = (1 - r^2)^(1/3): P(f <= x) = 1 - sqrt(1 - x^3)


def _radical_inverse_ranks(k: int) -> list[int]:
    """The rank of each index 0..k-1 in the order of its base-2 radical inverse (van der Corput): an ordering of the
    radii that is not correlated with the spiral's height, so large and small angles meet every axis direction."""
    def vdc(i: int) -> float:
        x, f = 0.0, 0.5
        while i:
            x, i, f = x + f * (i & 1), i >> 1, f * 0.5
        return x

    order = sorted(range(k), key=vdc)
    ranks = [0] * k
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def mosaic_set_turn(index: int) -> Tensor:
    """The ``index``-th fixed turn (3, 3) (float64) of an even mosaic set (``-mosaic_turn``): the identity for 0;
    for ``index >= 1`` the rotation by ``0.7 + 0.37 index`` rad about the unit axis of height
    ``z = 1 - 2 frac((index - 0.5) / 16)`` and azimuth ``index`` golden angles.  A turned set is as even as the
    set (its pairs stay ``+omega, -omega``; with 3 pairs or more its second moment stays the model's, being
    isotropic); only its orientation against the crystal changes, so the spread of a refined value over a few turns
    measures how much that value depends on where the domains happen to lie at this count."""
    if index < 0:
        raise ValueError(f"a mosaic set's turn is an index >= 0, got {index}")
    if index == 0:
        return torch.eye(3, dtype=torch.float64)
    z = 1.0 - 2.0 * (((index - 0.5) / 16.0) % 1.0)
    rho = math.sqrt(max(1.0 - z * z, 0.0))
    azimuth = index * _GOLDEN_ANGLE
    axis = torch.tensor([rho * math.cos(azimuth), rho * math.sin(azimuth), z], dtype=torch.float64)
    return rotation_matrix_from_vector(axis * (0.7 + 0.37 * index))


def even_mosaic_domains(count: int, model: str = "ball") -> tuple[Tensor, Tensor]:
    """An even, deterministic set of ``count`` mosaic domains: ``(axes (M, 3), fractions (M,))`` (float64, lab frame),
    domain m the rotation by ``spread * fractions[m]`` about ``axes[m]``; every domain weighs ``1 / count``.

    The domains' rotation vectors ``omega_m = fractions[m] axes[m]`` (in units of the spread) are a quadrature of
    the model's distribution of rotation vectors:

    * ``gaussian``: an isotropic 3-D Gaussian of standard deviation 1 per axis (so that the rotation about any fixed
      axis, a reflection's rocking angle, is Gaussian with sigma = the spread);
    * ``ball``: the C program's law (an isotropic axis, the angle ``(1 - r^2)^(1/3)`` spreads, r uniform in -1..1).

    Built as ``count // 2`` symmetric pairs ``+omega, -omega`` (the set's mean orientation is the crystal's own), plus
    the unrotated crystal when ``count`` is odd: the pairs' axes lie on a Fibonacci spiral over the upper hemisphere
    (even in area), their angles at the equal-mass quantiles of the model's angle law (each quantile once, ordered by
    the radical inverse so that the angles are not correlated with the axes' height).  With 3 pairs or more the set
    is then made exactly isotropic: its second moment is the model's (``I`` for ``gaussian``, ``E[f^2] / 3 I`` for
    ``ball``) by a symmetric linear map of the vectors, so every reflection's mosaic rocking width is the model's at
    any count; with fewer pairs the angles are scaled to the model's mean square.  No random numbers: the same count
    and model give the same set, bit for bit.
    """
    if model not in EVEN_MOSAIC_MODELS:
        raise ValueError(f"unknown even mosaic model {model!r} (expected one of {', '.join(EVEN_MOSAIC_MODELS)})")
    if count < 1:
        raise ValueError(f"an even mosaic set needs at least one domain, got {count}")
    pairs, centre = divmod(int(count), 2)
    dt = torch.float64
    if pairs == 0:
        return torch.tensor([[0.0, 0.0, 1.0]], dtype=dt), torch.zeros(1, dtype=dt)
    k = torch.arange(pairs, dtype=dt)
    z = 1.0 - (k + 0.5) / pairs
    rho = torch.sqrt(1.0 - z * z)
    azimuth = k * _GOLDEN_ANGLE
    axes = torch.stack((rho * torch.cos(azimuth), rho * torch.sin(azimuth), z), dim=-1)
    low = centre / count  # the unrotated domain takes the innermost 1/count of the law
    radii = torch.tensor([_radius_quantile(model, low + (1.0 - low) * (j + 0.5) / pairs)
                          for j in _radical_inverse_ranks(pairs)], dtype=dt)
    half = radii[:, None] * axes
    omega = torch.cat((half, -half) + ((torch.zeros(1, 3, dtype=dt),) if centre else ()))
    mean_square = 3.0 if model == "gaussian" else _BALL_MEAN_F2  # E|omega|^2 of the law
    if pairs >= 3:
        moment = omega.T @ omega / count
        evals, evecs = torch.linalg.eigh(moment)
        whiten = evecs @ torch.diag(torch.sqrt(mean_square / 3.0 / evals)) @ evecs.T
        omega = omega @ whiten
    else:
        omega = omega * math.sqrt(mean_square / float((omega * omega).sum(-1).mean()))
    fractions = torch.linalg.vector_norm(omega, dim=-1)
    axes_out = torch.where(fractions[:, None] > 0, omega / fractions.clamp_min(1e-300)[:, None],
                           torch.tensor([0.0, 0.0, 1.0], dtype=dt))
    return axes_out, fractions
