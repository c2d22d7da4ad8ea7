"""Kahn polarization factor against the C's atan2 formulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbtorch.physics.polarization import kahn_polarization

DT = torch.float64


def _unit(v):
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def _kahn_c(incident: np.ndarray, diffracted: np.ndarray, polar_axis: np.ndarray, k: float) -> np.ndarray:
    """nanoBragg's polarization_factor(): psi = -atan2(d.B_in, d.E_in)."""
    out = []
    for i, d in zip(incident, diffracted):
        cos2t = float(np.dot(i, d))
        sin2t_sq = 1.0 - cos2t * cos2t
        b_in = _unit(np.cross(polar_axis, i))
        e_in = _unit(np.cross(i, b_in))
        psi = -math.atan2(float(np.dot(d, b_in)), float(np.dot(d, e_in)))
        out.append(0.5 * (1.0 + cos2t * cos2t - k * math.cos(2.0 * psi) * sin2t_sq))
    return np.array(out)


def _random_dirs(n: int, seed: int, around: np.ndarray | None = None, spread: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, 3))
    if around is not None:
        v = around + spread * v
    return _unit(v)


@pytest.mark.parametrize("k", [0.0, 0.5, 1.0, -0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_atan2_formula_random_directions(k, seed):
    beam = np.array([1.0, 0.0, 0.0])
    polar = np.array([0.0, 0.0, 1.0])
    # incident rays near the beam (divergence) and fully random diffracted rays
    inc = _random_dirs(100, seed, around=beam, spread=0.02)
    dif = _random_dirs(100, seed + 10)
    got = kahn_polarization(torch.tensor(inc), torch.tensor(dif), torch.tensor(polar), torch.tensor(k, dtype=DT))
    np.testing.assert_allclose(got.numpy(), _kahn_c(inc, dif, polar, k), rtol=0, atol=1e-13)


@pytest.mark.parametrize("beam, polar", [((0.0, 0.0, 1.0), (0.0, 1.0, 0.0)), ((0.0, 0.0, 1.0), (1.0, 0.0, 0.0))])
def test_matches_atan2_formula_other_conventions(beam, polar):
    beam, polar = np.array(beam), np.array(polar)
    inc = np.tile(beam, (60, 1))
    dif = _random_dirs(60, 5, around=beam, spread=0.6)
    got = kahn_polarization(torch.tensor(inc), torch.tensor(dif), torch.tensor(polar), torch.tensor(0.5, dtype=DT))
    np.testing.assert_allclose(got.numpy(), _kahn_c(inc, dif, polar, 0.5), rtol=0, atol=1e-13)


def test_unpolarized_is_half_one_plus_cos_sq():
    inc = torch.tensor([[1.0, 0.0, 0.0]], dtype=DT).expand(50, 3)
    dif = torch.tensor(_random_dirs(50, 3))
    p = kahn_polarization(inc, dif, torch.tensor([0.0, 0.0, 1.0], dtype=DT), torch.tensor(0.0, dtype=DT))
    cos2t = dif[:, 0]
    assert torch.allclose(p, 0.5 * (1 + cos2t**2), rtol=0, atol=1e-15)


def test_fully_polarized_limits():
    """K = 1: no scattering along E (at 2theta = 90), full scattering perpendicular to it."""
    inc = torch.tensor([[1.0, 0.0, 0.0]] * 2, dtype=DT)
    dif = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=DT)  # along E, along B
    p = kahn_polarization(inc, dif, torch.tensor([0.0, 0.0, 1.0], dtype=DT), torch.tensor(1.0, dtype=DT))
    assert torch.allclose(p, torch.tensor([0.0, 1.0], dtype=DT), atol=1e-15)


def test_finite_gradient_along_the_beam():
    """atan2(0, 0) has no derivative; the e^2 - b^2 form is smooth through the direct beam."""
    inc = torch.tensor([[1.0, 0.0, 0.0]], dtype=DT)
    polar = torch.tensor([0.0, 0.0, 1.0], dtype=DT)
    for k in (0.0, 0.5, 1.0):
        dif = torch.tensor([[1.0, 0.0, 0.0]], dtype=DT, requires_grad=True)
        kk = torch.tensor(k, dtype=DT, requires_grad=True)
        p = kahn_polarization(inc, dif, polar, kk)
        assert p.item() == pytest.approx(1.0, abs=1e-15)
        g_d, g_k = torch.autograd.grad(p.sum(), (dif, kk))
        assert torch.isfinite(g_d).all() and torch.isfinite(g_k).all()
    # derivative of a pixel position through normalisation, at and near the beam
    pos = torch.tensor([[0.1, 0.0, 0.0], [0.1, 1e-7, -2e-7]], dtype=DT, requires_grad=True)
    p = kahn_polarization(inc.expand(2, 3), pos / pos.norm(dim=-1, keepdim=True), polar, torch.tensor(0.5, dtype=DT))
    g, = torch.autograd.grad(p.sum(), pos)
    assert torch.isfinite(g).all()


def test_gradcheck():
    inc = torch.tensor(_random_dirs(5, 8, around=np.array([1.0, 0, 0]), spread=0.01), requires_grad=True)
    dif = torch.tensor(np.vstack([_random_dirs(4, 9), [[1.0, 0.0, 0.0]]]), requires_grad=True)
    polar = torch.tensor([0.0, 0.0, 1.0], dtype=DT)
    kk = torch.tensor(0.6, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda i, d, k: kahn_polarization(i, d, polar, k), (inc, dif, kk))
