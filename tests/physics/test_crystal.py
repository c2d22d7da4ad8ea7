"""Unit cell, reciprocal basis and orientation: spec exactness, the C's triclinic quirk, gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbtorch.physics.crystal import (
    cell_from_reciprocal,
    cell_from_vectors,
    cell_volume,
    crystal_real_and_reciprocal,
    orientation_from_reciprocal,
    reciprocal_basis_from_cell,
)
from nbtorch.physics.rotation import rotation_matrix_xyz

DT = torch.float64
EYE = torch.eye(3, dtype=DT)
TRICLINIC = (70.0, 80.0, 90.0, 75.0, 85.0, 95.0)


def _cell(a, b, c, al, be, ga, requires_grad=False) -> torch.Tensor:
    return torch.tensor([a, b, c, math.radians(al), math.radians(be), math.radians(ga)], dtype=DT,
                        requires_grad=requires_grad)


def _deg(cell: torch.Tensor) -> np.ndarray:
    out = cell.detach().numpy().copy()
    out[3:] = np.degrees(out[3:])
    return out


def _random_triclinic_cells(n: int, seed: int) -> list[torch.Tensor]:
    """Valid, well-conditioned triclinic cells (all three angles away from 90)."""
    rng = np.random.default_rng(seed)
    cells = []
    while len(cells) < n:
        lengths = rng.uniform(20.0, 150.0, 3)
        angles = rng.uniform(60.0, 120.0, 3)
        al, be, ga = angles
        if not (al < be + ga and be < al + ga and ga < al + be and al + be + ga < 360.0):
            continue
        if np.min(np.abs(angles - 90.0)) < 3.0:
            continue
        c = np.radians(angles)
        if 1 - np.sum(np.cos(c) ** 2) + 2 * np.prod(np.cos(c)) < 0.05:  # nearly flat cell
            continue
        cells.append(_cell(*lengths, *angles))
    return cells


def _random_rotation(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ang = (torch.rand(3, generator=g, dtype=DT) * 2 - 1) * math.pi
    return rotation_matrix_xyz(ang[0], ang[1], ang[2])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_metric_duality_spec_triclinic(seed):
    for i, cell in enumerate(_random_triclinic_cells(5, seed)):
        u = _random_rotation(100 * seed + i)
        real, recip = crystal_real_and_reciprocal(cell, u, c_parity=False)
        assert torch.allclose(real @ recip.T, EYE, atol=1e-12, rtol=0)
        # the default-frame reciprocal basis itself is dual to the real basis (spec c*_z formula)
        recip0, _ = reciprocal_basis_from_cell(cell, c_parity=False)
        assert torch.allclose(real @ (recip0 @ u.T).T, EYE, atol=1e-12, rtol=0)


def test_metric_duality_fails_for_c_formula_on_triclinic():
    """The C's c*_z is not dual to the real vectors it builds (this is why spec differs)."""
    cell = _cell(*TRICLINIC)
    real, _ = crystal_real_and_reciprocal(cell, EYE, c_parity=True)
    recip0, _ = reciprocal_basis_from_cell(cell, c_parity=True)
    assert (real @ recip0.T - EYE).abs().max() > 1e-4


def test_spec_reproduces_requested_triclinic_cell():
    cell = _cell(*TRICLINIC)
    for u in (EYE, rotation_matrix_xyz(*(torch.tensor(math.radians(v), dtype=DT) for v in (10.0, 20.0, 30.0)))):
        real, recip = crystal_real_and_reciprocal(cell, u, c_parity=False)
        np.testing.assert_allclose(_deg(cell_from_vectors(real)), TRICLINIC, rtol=0, atol=1e-10)
        np.testing.assert_allclose(_deg(cell_from_reciprocal(recip)), TRICLINIC, rtol=0, atol=1e-10)


def test_c_parity_gives_distorted_triclinic_angles():
    cell = _cell(*TRICLINIC)
    real, _ = crystal_real_and_reciprocal(cell, EYE, c_parity=True)
    got = _deg(cell_from_vectors(real))
    # lengths are forced exactly; angles are the C's (stdout "Unit Cell:" line)
    np.testing.assert_allclose(got[:3], TRICLINIC[:3], rtol=0, atol=1e-10)
    np.testing.assert_allclose(got[3:], [75.0391, 85.0136, 95.0081], rtol=0, atol=1e-3)
    assert np.abs(got[3:] - np.array(TRICLINIC[3:])).max() > 5e-3


@pytest.mark.parametrize(
    "cell",
    [
        (100.0, 100.0, 100.0, 90.0, 90.0, 90.0),  # cubic
        (50.0, 70.0, 120.0, 90.0, 90.0, 90.0),  # orthorhombic
        (60.0, 80.0, 95.0, 90.0, 104.5, 90.0),  # monoclinic, unique b
        (60.0, 60.0, 95.0, 90.0, 90.0, 120.0),  # hexagonal (one angle off 90)
    ],
)
def test_single_non_right_angle_cells_identical_in_both_modes(cell):
    t = _cell(*cell)
    u = _random_rotation(7)
    r0, _ = reciprocal_basis_from_cell(t, c_parity=False)
    r1, _ = reciprocal_basis_from_cell(t, c_parity=True)
    assert torch.allclose(r0, r1, atol=1e-15, rtol=1e-13)
    real_s, recip_s = crystal_real_and_reciprocal(t, u, c_parity=False)
    real_c, recip_c = crystal_real_and_reciprocal(t, u, c_parity=True)
    assert torch.allclose(real_s, real_c, atol=1e-11, rtol=0)
    assert torch.allclose(recip_s, recip_c, atol=1e-15, rtol=1e-12)
    np.testing.assert_allclose(_deg(cell_from_vectors(real_c)), cell, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_volume_formula(seed):
    cells = _random_triclinic_cells(6, seed) + [_cell(100, 100, 100, 90, 90, 90), _cell(50, 60, 70, 90, 100, 90)]
    for cell in cells:
        a, b, c, al, be, ga = cell.unbind(-1)
        v = cell_volume(a, b, c, al, be, ga)
        ca, cb, cg = torch.cos(al), torch.cos(be), torch.cos(ga)
        closed = a * b * c * torch.sqrt(1 - ca**2 - cb**2 - cg**2 + 2 * ca * cb * cg)
        assert torch.allclose(v, closed, rtol=1e-12, atol=0)
        real, recip = crystal_real_and_reciprocal(cell, _random_rotation(seed), c_parity=False)
        assert torch.allclose(torch.linalg.det(real), v, rtol=1e-12, atol=0)
        assert torch.allclose(torch.linalg.det(recip), 1.0 / v, rtol=1e-12, atol=0)
        _, v2 = reciprocal_basis_from_cell(cell)
        assert torch.allclose(v2, v, rtol=0, atol=0)
    assert torch.allclose(cell_volume(*_cell(10, 20, 30, 90, 90, 90).unbind(-1)), torch.tensor(6000.0, dtype=DT))


def test_default_orientation_convention():
    """a* along +x, b* in the x-y plane, right-handed."""
    recip0, _ = reciprocal_basis_from_cell(_cell(*TRICLINIC))
    assert recip0[0, 1] == 0 and recip0[0, 2] == 0 and recip0[1, 2] == 0
    assert recip0[0, 0] > 0 and recip0[1, 1] > 0 and recip0[2, 2] > 0
    assert torch.linalg.det(recip0) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orientation_from_reciprocal_round_trip(seed):
    for i, cell in enumerate(_random_triclinic_cells(3, seed) + [_cell(60, 80, 95, 90, 104.5, 90)]):
        u = _random_rotation(10 * seed + i)
        recip0, _ = reciprocal_basis_from_cell(cell)
        recip = recip0 @ u.T
        cell2, u2 = orientation_from_reciprocal(recip)
        assert torch.allclose(cell2, cell, atol=1e-10, rtol=0)
        assert torch.allclose(u2, u, atol=1e-10, rtol=0)
        # feeding the result back gives the same oriented crystal
        real_a, recip_a = crystal_real_and_reciprocal(cell, u)
        real_b, recip_b = crystal_real_and_reciprocal(cell2, u2)
        assert torch.allclose(real_a, real_b, atol=1e-9, rtol=0)
        assert torch.allclose(recip_b, recip, atol=1e-13, rtol=1e-10)


def test_orientation_from_reciprocal_rejects_left_handed():
    recip0, _ = reciprocal_basis_from_cell(_cell(*TRICLINIC))
    mirror = torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=DT))
    with pytest.raises(ValueError):
        orientation_from_reciprocal(recip0 @ mirror)


@pytest.mark.parametrize("c_parity", [False, True])
def test_gradcheck_crystal_wrt_cell(c_parity):
    cell = _cell(*TRICLINIC, requires_grad=True)
    u = _random_rotation(3)

    def f(c):
        real, recip = crystal_real_and_reciprocal(c, u, c_parity=c_parity)
        return real, recip * 100.0  # comparable magnitudes

    assert torch.autograd.gradcheck(f, (cell,), eps=1e-6, atol=1e-6)


def test_gradcheck_crystal_wrt_orientation_angles():
    cell = _cell(*TRICLINIC)
    ang = torch.tensor([0.2, -0.3, 0.5], dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a: crystal_real_and_reciprocal(cell, rotation_matrix_xyz(a[0], a[1], a[2]))[0], (ang,)
    )
