"""Rotations: orthonormality, agreement between the three constructions, gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbtorch.physics.rotation import rotate_axis, rotation_matrix_axis_angle, rotation_matrix_xyz

DT = torch.float64


def _random_axes_angles(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    axes = torch.randn(n, 3, generator=g, dtype=DT)
    axes = axes / axes.norm(dim=-1, keepdim=True)
    angles = (torch.rand(n, generator=g, dtype=DT) * 2.0 - 1.0) * 2.0 * math.pi
    return axes, angles


def _assert_proper_rotation(r: torch.Tensor) -> None:
    eye = torch.eye(3, dtype=DT).expand_as(r)
    assert torch.allclose(r @ r.transpose(-1, -2), eye, atol=1e-13, rtol=0)
    assert torch.allclose(r.transpose(-1, -2) @ r, eye, atol=1e-13, rtol=0)
    assert torch.allclose(torch.linalg.det(r), torch.ones(r.shape[:-2], dtype=DT), atol=1e-13, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_axis_angle_matrix_is_proper_rotation(seed):
    axes, angles = _random_axes_angles(50, seed)
    r = rotation_matrix_axis_angle(axes, angles)
    assert r.shape == (50, 3, 3)
    _assert_proper_rotation(r)
    # the axis is invariant and the angle is recovered from the trace
    assert torch.allclose((r @ axes[..., None])[..., 0], axes, atol=1e-13, rtol=0)
    cos_t = (torch.diagonal(r, dim1=-2, dim2=-1).sum(-1) - 1.0) / 2.0
    assert torch.allclose(cos_t, torch.cos(angles), atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_xyz_matrix_is_proper_rotation(seed):
    g = torch.Generator().manual_seed(seed)
    ang = (torch.rand(40, 3, generator=g, dtype=DT) * 2.0 - 1.0) * math.pi
    r = rotation_matrix_xyz(ang[:, 0], ang[:, 1], ang[:, 2])
    assert r.shape == (40, 3, 3)
    _assert_proper_rotation(r)


def test_right_handed_sense():
    """Counter-clockwise looking down the axis: z by +90 deg takes x to y."""
    z = torch.tensor([0.0, 0.0, 1.0], dtype=DT)
    x = torch.tensor([1.0, 0.0, 0.0], dtype=DT)
    y = torch.tensor([0.0, 1.0, 0.0], dtype=DT)
    quarter = torch.tensor(math.pi / 2, dtype=DT)
    assert torch.allclose(rotate_axis(x, z, quarter), y, atol=1e-15)
    assert torch.allclose(rotation_matrix_axis_angle(z, quarter) @ x, y, atol=1e-15)
    zero = torch.tensor(0.0, dtype=DT)
    assert torch.allclose(rotation_matrix_xyz(zero, zero, quarter) @ x, y, atol=1e-15)
    # about x: y -> z; about y: z -> x
    assert torch.allclose(rotation_matrix_xyz(quarter, zero, zero) @ y, z, atol=1e-15)
    assert torch.allclose(rotation_matrix_xyz(zero, quarter, zero) @ z, x, atol=1e-15)


@pytest.mark.parametrize("seed", [6, 7])
def test_rotate_axis_matches_matrix(seed):
    axes, angles = _random_axes_angles(64, seed)
    g = torch.Generator().manual_seed(seed + 100)
    v = torch.randn(64, 3, generator=g, dtype=DT) * 5.0
    by_matrix = (rotation_matrix_axis_angle(axes, angles) @ v[..., None])[..., 0]
    direct = rotate_axis(v, axes, angles)
    assert torch.allclose(direct, by_matrix, atol=1e-12, rtol=0)
    # lengths are preserved
    assert torch.allclose(direct.norm(dim=-1), v.norm(dim=-1), atol=1e-12, rtol=0)


def test_rotate_axis_broadcasts_one_axis_over_many_vectors():
    axis = torch.tensor([1.0, 2.0, -2.0], dtype=DT) / 3.0
    v = torch.randn(10, 3, generator=torch.Generator().manual_seed(9), dtype=DT)
    angle = torch.tensor(0.7, dtype=DT)
    out = rotate_axis(v, axis, angle)
    ref = (rotation_matrix_axis_angle(axis, angle) @ v.T).T
    assert torch.allclose(out, ref, atol=1e-13, rtol=0)


def _hand_xyz(rx: float, ry: float, rz: float) -> np.ndarray:
    cx, sx = math.cos(rx), math.sin(rx)
    cy, sy = math.cos(ry), math.sin(ry)
    cz, sz = math.cos(rz), math.sin(rz)
    mx = np.array([[1.0, 0.0, 0.0], [0.0, cx, -sx], [0.0, sx, cx]])
    my = np.array([[cy, 0.0, sy], [0.0, 1.0, 0.0], [-sy, 0.0, cy]])
    mz = np.array([[cz, -sz, 0.0], [sz, cz, 0.0], [0.0, 0.0, 1.0]])
    return mz @ my @ mx


@pytest.mark.parametrize("angles", [(0.1, 0.2, 0.3), (-1.0, 2.5, 0.7), (math.radians(10), math.radians(20), math.radians(30))])
def test_xyz_equals_rz_ry_rx_by_hand(angles):
    rx, ry, rz = angles
    r = rotation_matrix_xyz(*(torch.tensor(a, dtype=DT) for a in angles))
    np.testing.assert_allclose(r.numpy(), _hand_xyz(rx, ry, rz), atol=1e-15, rtol=0)
    # and as the composition of axis-angle rotations about the lab axes (x first)
    e = torch.eye(3, dtype=DT)
    comp = (
        rotation_matrix_axis_angle(e[2], torch.tensor(rz, dtype=DT))
        @ rotation_matrix_axis_angle(e[1], torch.tensor(ry, dtype=DT))
        @ rotation_matrix_axis_angle(e[0], torch.tensor(rx, dtype=DT))
    )
    assert torch.allclose(r, comp, atol=1e-14, rtol=0)
    # the order matters: Rx @ Ry @ Rz is a different matrix for these angles
    wrong = _hand_xyz(rx, 0, 0) @ _hand_xyz(0, ry, 0) @ _hand_xyz(0, 0, rz)
    assert np.abs(wrong - r.numpy()).max() > 1e-3


def test_gradcheck_rotate_axis_wrt_angle_and_vector():
    g = torch.Generator().manual_seed(11)
    axis = torch.randn(4, 3, generator=g, dtype=DT)
    axis = axis / axis.norm(dim=-1, keepdim=True)
    v = torch.randn(4, 3, generator=g, dtype=DT, requires_grad=True)
    angle = torch.tensor([0.3, -1.2, 2.9, 0.0], dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda vv, aa: rotate_axis(vv, axis, aa), (v, angle))
    assert torch.autograd.gradgradcheck(lambda vv, aa: rotate_axis(vv, axis, aa), (v, angle))


def test_gradcheck_matrices_wrt_angles():
    axis = torch.tensor([0.0, 0.6, 0.8], dtype=DT)
    a = torch.tensor([0.4, -2.0], dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rotation_matrix_axis_angle(axis, t), (a,))
    rx = torch.tensor(0.1, dtype=DT, requires_grad=True)
    ry = torch.tensor(-0.5, dtype=DT, requires_grad=True)
    rz = torch.tensor(1.3, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(rotation_matrix_xyz, (rx, ry, rz))
