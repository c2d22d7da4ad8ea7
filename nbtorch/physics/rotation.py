"""Rotations of 3-vectors.

Conventions (as in nanoBragg):

* all rotations are right-handed (counter-clockwise looking down the axis
  towards the origin), angles in radians;
* ``rotation_matrix_xyz(rx, ry, rz)`` rotates about the lab X axis first, then
  Y, then Z: ``R = Rz @ Ry @ Rx`` (used for ``-misset`` and
  ``-detector_rotx/y/z``);
* ``rotate_axis(v, axis, angle)`` is Rodrigues' formula about a unit axis
  (used for phi, two-theta, divergence and the curved detector).

Vectors live in the last dimension, shape ``(..., 3)``; matrices are
``(..., 3, 3)`` and act on column vectors (``v' = R @ v``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _cross_matrix(axis: Tensor) -> Tensor:
    """Skew matrix K with K @ v = axis x v.  axis: (..., 3) -> (..., 3, 3)."""
    x, y, z = axis.unbind(-1)
    zero = torch.zeros_like(x)
    return torch.stack(
        (
            torch.stack((zero, -z, y), -1),
            torch.stack((z, zero, -x), -1),
            torch.stack((-y, x, zero), -1),
        ),
        -2,
    )


def rotation_matrix_axis_angle(axis: Tensor, angle: Tensor) -> Tensor:
    """Rotation matrix about a unit ``axis`` (..., 3) by ``angle`` (...) in radians.

    Returns (..., 3, 3).  Rodrigues: ``R = cos t I + sin t K + (1 - cos t) k k^T``.
    """
    angle = torch.as_tensor(angle, dtype=axis.dtype, device=axis.device)
    c = torch.cos(angle)[..., None, None]
    s = torch.sin(angle)[..., None, None]
    eye = torch.eye(3, dtype=axis.dtype, device=axis.device)
    outer = axis[..., :, None] * axis[..., None, :]
    return c * eye + s * _cross_matrix(axis) + (1.0 - c) * outer


def rotate_axis(v: Tensor, axis: Tensor, angle: Tensor) -> Tensor:
    """Rotate vectors ``v`` (..., 3) about unit ``axis`` (..., 3) by ``angle`` (...) radians."""
    angle = torch.as_tensor(angle, dtype=v.dtype, device=v.device)
    c = torch.cos(angle)[..., None]
    s = torch.sin(angle)[..., None]
    dot = (axis * v).sum(-1, keepdim=True)
    return v * c + torch.linalg.cross(axis.expand_as(v), v, dim=-1) * s + axis * dot * (1.0 - c)


def rotation_matrix_xyz(rx: Tensor, ry: Tensor, rz: Tensor) -> Tensor:
    """``Rz @ Ry @ Rx`` for angles in radians (scalars or broadcastable tensors)."""
    ref = next((v for v in (rx, ry, rz) if isinstance(v, Tensor)), None)
    dtype = ref.dtype if ref is not None else torch.get_default_dtype()
    device = ref.device if ref is not None else None
    rx, ry, rz = torch.broadcast_tensors(
        *(torch.as_tensor(v, dtype=dtype, device=device) for v in (rx, ry, rz))
    )
    one = torch.ones_like(rx)
    zero = torch.zeros_like(rx)

    def mat(rows):
        return torch.stack([torch.stack(r, -1) for r in rows], -2)

    cx, sx = torch.cos(rx), torch.sin(rx)
    cy, sy = torch.cos(ry), torch.sin(ry)
    cz, sz = torch.cos(rz), torch.sin(rz)
    mx = mat(((one, zero, zero), (zero, cx, -sx), (zero, sx, cx)))
    my = mat(((cy, zero, sy), (zero, one, zero), (-sy, zero, cy)))
    mz = mat(((cz, -sz, zero), (sz, cz, zero), (zero, zero, one)))
    return mz @ my @ mx


def rotation_matrix_from_vector(omega: Tensor) -> Tensor:
    """Rotation by the rotation vector ``omega`` (..., 3): about ``omega / |omega|`` by ``|omega|`` radians.

    Returns (..., 3, 3), ``exp([omega]x) = I + (sin t / t) K + ((1 - cos t) / t^2) K^2`` with ``K = [omega]x``,
    ``t = |omega|``.  Smooth everywhere, the zero vector included (the identity there, with the derivative
    ``[d omega]x``): below ``t^2 = 1e-8`` the two coefficients are their Taylor series, and ``(1 - cos t) / t^2``
    is written ``(sin(t/2) / (t/2))^2 / 2`` (no cancellation).  Equals :func:`rotation_matrix_axis_angle` of the
    unit axis and ``t`` to rounding.
    """
    t2 = (omega * omega).sum(-1)
    small = t2 < 1e-8
    t = torch.sqrt(torch.where(small, torch.ones_like(t2), t2))  # a safe value where the series is used
    sin_t = torch.where(small, 1.0 - t2 / 6.0 + t2 * t2 / 120.0, torch.sin(t) / t)
    half = torch.where(small, 1.0 - t2 / 24.0 + t2 * t2 / 1920.0, torch.sin(0.5 * t) / (0.5 * t))
    k = _cross_matrix(omega)
    eye = torch.eye(3, dtype=omega.dtype, device=omega.device)
    return eye + sin_t[..., None, None] * k + (0.5 * half * half)[..., None, None] * (k @ k)
