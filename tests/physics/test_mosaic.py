"""The anisotropic mosaic (nbtorch.physics.mosaic, -mosaic_abc): the relation to the isotropic model, the
crystal frame, the rotations' smoothness at zero, and what the set-up resolves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

from nbtorch import Simulator, config_from_args
from nbtorch.sampling.crng import mosaic_domain_draws
from nbtorch.physics.mosaic import anisotropic_mosaic_rotations, crystal_frame, isotropic_mosaic_rotations
from nbtorch.physics.rotation import rotation_matrix_axis_angle, rotation_matrix_from_vector

DT = torch.float64
BASE = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1.0 -default_F 100 -distance 100 -detpixels 48 "
        "-pixel 0.5 -mosaic_dom 12 -mosaic_seed 7 -oversample 1")


def _image(flags: str) -> torch.Tensor:
    return Simulator(config_from_args(f"{BASE} {flags}".split()), compile=False)()


def test_rotation_vector_matches_axis_angle_and_is_smooth_at_zero():
    rng = np.random.default_rng(1)
    axes = torch.tensor(rng.normal(size=(6, 3)), dtype=DT)
    axes = axes / axes.norm(dim=-1, keepdim=True)
    angles = torch.tensor([0.0, 1e-6, 3e-4, 0.01, 0.7, 2.5], dtype=DT)
    got = rotation_matrix_from_vector(axes * angles[:, None])
    assert torch.allclose(got, rotation_matrix_axis_angle(axes, angles), rtol=0, atol=1e-15)
    assert torch.equal(rotation_matrix_from_vector(torch.zeros(3, dtype=DT)), torch.eye(3, dtype=DT))
    for omega in (torch.zeros(3, dtype=DT), torch.tensor([3e-5, -2e-5, 1e-5], dtype=DT),
                  torch.tensor([0.3, -0.2, 0.5], dtype=DT)):
        assert gradcheck(rotation_matrix_from_vector, (omega.clone().requires_grad_(True),), eps=1e-7, atol=1e-9)


def test_crystal_frame_is_orthonormal_along_a_and_c_star():
    real = torch.tensor([[70.0, 0.0, 0.0], [10.0, 78.0, 0.0], [12.0, -5.0, 88.0]], dtype=DT)
    e = crystal_frame(real)
    assert torch.allclose(e @ e.T, torch.eye(3, dtype=DT), atol=1e-15)
    assert float(torch.linalg.det(e)) == pytest.approx(1.0, abs=1e-15)
    assert torch.allclose(e[0], real[0] / real[0].norm(), atol=1e-15)
    assert abs(float(e[2] @ real[0])) < 1e-12 and abs(float(e[2] @ real[1])) < 1e-12  # z along a x b (c*)


def test_equal_spreads_are_the_isotropic_domains():
    axes, fracs = (torch.tensor(v, dtype=DT) for v in mosaic_domain_draws(9, 7))
    r_phi = rotation_matrix_axis_angle(torch.tensor([[1.0, 0, 0]] * 3, dtype=DT), torch.tensor([0.0, 0.1, 0.2], dtype=DT))
    frame = crystal_frame(torch.tensor([[70.0, 3, 1], [-2, 80, 4], [5, 6, 90]], dtype=DT))
    eta = torch.tensor(math.radians(0.7), dtype=DT)
    aniso = anisotropic_mosaic_rotations(axes, fracs, eta.expand(3), frame, r_phi)
    iso = isotropic_mosaic_rotations(axes, fracs, eta)
    assert torch.allclose(aniso, iso.expand_as(aniso), rtol=0, atol=1e-15)
    assert torch.equal(aniso[:, 0], torch.eye(3, dtype=DT).expand(3, 3, 3))  # domain 0 is the crystal itself


def test_spread_about_one_axis_rotates_about_that_axis_only():
    """Only eta_c > 0: every domain turns about the crystal's z (c* = c for this cell), which it leaves fixed;
    with phi steps the axis turns with the crystal."""
    axes, fracs = (torch.tensor(v, dtype=DT) for v in mosaic_domain_draws(9, 7))
    real = torch.tensor([[60.0, 0, 0], [0, 60, 0], [0, 0, 150]], dtype=DT)
    misset = rotation_matrix_axis_angle(torch.tensor([0.3, 0.5, 0.8], dtype=DT) / math.sqrt(0.98), torch.tensor(0.4))
    real = real @ misset.T
    r_phi = rotation_matrix_axis_angle(torch.tensor([[0.0, 1, 0]] * 2, dtype=DT), torch.tensor([0.0, 0.3], dtype=DT))
    u = anisotropic_mosaic_rotations(axes, fracs, torch.tensor([0.0, 0.0, 0.05], dtype=DT), crystal_frame(real), r_phi)
    for k in range(2):
        c_phi = r_phi[k] @ real[2]
        assert torch.allclose(u[k] @ c_phi, c_phi.expand(9, 3), atol=1e-12)
        a_phi = r_phi[k] @ real[0]
        assert float((u[k] @ a_phi - a_phi).norm(dim=-1).max()) > 0.1  # a itself moves


def test_simulator_equal_spreads_reproduce_the_isotropic_image():
    for flags in ("-mosaic 0.8", "-mosaic 0.8 -phi 0 -osc 2 -phisteps 3"):
        iso = _image(flags)
        aniso = _image(flags + " -mosaic_abc 0.8 0.8 0.8")
        assert float(iso.max()) > 0
        assert float((aniso - iso).abs().max() / iso.max()) < 1e-12
    assert float((_image("-mosaic 0.8 -mosaic_abc 0.2 0.8 2.0") - iso).abs().max() / iso.max()) > 0.01


def test_setup_of_the_anisotropic_mosaic():
    sim = Simulator(config_from_args(f"{BASE} -mosaic_abc 0.1 0.2 0.3".replace("-mosaic_dom 12 ", "").split()),
                    compile=False)
    s = sim.setup.sampling
    assert s.mosaic_anisotropic and len(s.mosaic_fractions) == 10  # the C's default count for a spread > 0
    assert [float(getattr(sim, n)) for n in ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")] == [0.1, 0.2, 0.3]
    iso = Simulator(config_from_args(f"{BASE} -mosaic 0.4".split()), compile=False)
    assert not iso.setup.sampling.mosaic_anisotropic
    assert {float(getattr(iso, n)) for n in ("mosaic_spread", "mosaic_spread_a", "mosaic_spread_b")} == {0.4}
    zero = Simulator(config_from_args(f"{BASE} -mosaic_abc 0 0 0".split()), compile=False)
    assert len(zero.setup.sampling.mosaic_fractions) == 1 and torch.isfinite(zero()).all()


def test_gradient_of_the_spreads_is_finite_with_all_spreads_zero():
    """Spreads at exactly 0 (the rotation vectors all zero): the derivative exists and is finite."""
    sim = Simulator(config_from_args(f"{BASE} -mosaic_abc 0.3 0.3 0.3".split()), compile=False)
    x = torch.zeros(3, dtype=DT, requires_grad=True)
    img = sim(mosaic_spread_a=x[0], mosaic_spread_b=x[1], mosaic_spread_c=x[2])
    (g,) = torch.autograd.grad((img * img).sum(), x)
    assert torch.isfinite(g).all()
