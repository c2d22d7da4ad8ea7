"""The anisotropic Gaussian crystal (``-gauss_aniso_xtal``): values, the diagonal case, the integrated spot,
derivatives, and the simulator and esd paths through it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbtorch import config as nb_config
from nbtorch.physics import lattice
from nbtorch.physics.lattice import anisotropic_gauss, lattice_factor, nearest_index, size_matrix_determinant

DT = torch.float64
#: Na Nb Nc Nd Ne Nf of a positive definite, clearly non-diagonal size matrix (unit cells)
SIZES = (3.0, 5.0, 8.0, 1.0, -1.5, 0.8)


def _matrix(n) -> np.ndarray:
    na, nb, nc, nd, ne, nf = n
    return np.array([[na, nd, nf], [nd, nb, ne], [nf, ne, nc]], dtype=np.float64)


def _numpy_factor(hkl: np.ndarray, n, fudge: float = 1.0) -> np.ndarray:
    """Direct evaluation: ``det(N) exp(-(N dh).(N dh) fudge / 0.63)`` with ``dh = hkl - round(hkl)``."""
    dh = hkl - np.ceil(hkl - 0.5)
    m = _matrix(n)
    u = dh @ m.T
    return np.linalg.det(m) * np.exp(-np.einsum("...i,...i->...", u, u) * fudge / 0.63)


def test_values_match_a_direct_numpy_evaluation():
    rng = np.random.default_rng(3)
    hkl = rng.uniform(-20.0, 20.0, (500, 3))
    hkl[:20] = np.round(hkl[:20])  # on the lattice points: the peak det N
    for fudge in (1.0, 0.7):
        want = _numpy_factor(hkl, SIZES, fudge)
        h = torch.tensor(hkl, dtype=DT)
        got = lattice_factor(h, nearest_index(h), torch.tensor(SIZES, dtype=DT), "gauss_aniso", fudge=fudge)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=1e-300)
    assert np.allclose(want[:20], np.linalg.det(_matrix(SIZES)), rtol=1e-14)
    assert float(size_matrix_determinant(torch.tensor(SIZES, dtype=DT))) == pytest.approx(
        np.linalg.det(_matrix(SIZES)), rel=1e-14)


def test_diagonal_matrix_is_one_gaussian_per_axis():
    """Nd = Ne = Nf = 0: ``Na Nb Nc exp(-sum (N_i dh_i)^2 / 0.63)``, the product of three 1-d Gaussians, with the
    per-axis radius the round crystal uses (``hrad^2 = sum dh_i^2 N_i^2``); isotropic: ``N^3 exp(-N^2 |dh|^2/0.63)``."""
    rng = np.random.default_rng(5)
    h = torch.tensor(rng.uniform(-6.0, 6.0, (300, 3)), dtype=DT)
    dh = h - nearest_index(h)
    diag = torch.tensor([3.0, 5.0, 8.0], dtype=DT)
    six = torch.cat([diag, torch.zeros(3, dtype=DT)])
    got = lattice_factor(h, nearest_index(h), six, "gauss_aniso")
    per_axis = [n * torch.exp(-(n * dh[:, i]) ** 2 / 0.63) for i, n in enumerate(diag)]
    assert torch.allclose(got, per_axis[0] * per_axis[1] * per_axis[2], rtol=1e-13, atol=0)
    hrad2 = (dh * dh * diag * diag).sum(-1)
    assert torch.allclose(got, 120.0 * torch.exp(-hrad2 / 0.63), rtol=1e-13, atol=0)
    iso = lattice_factor(h, nearest_index(h), torch.tensor([4.0, 4.0, 4.0, 0, 0, 0], dtype=DT), "gauss_aniso")
    assert torch.allclose(iso, 64.0 * torch.exp(-16.0 * (dh * dh).sum(-1) / 0.63), rtol=1e-13, atol=0)


def _integrated(n, grid: int = 96) -> float:
    """``sum F^2`` over one reciprocal unit cell (Miller units), midpoint rule."""
    x = (torch.arange(grid, dtype=DT) + 0.5) / grid - 0.5
    h, k, l = torch.meshgrid(x, x, x, indexing="ij")
    f = anisotropic_gauss((h, k, l), torch.tensor(n, dtype=DT))
    return float((f * f).sum()) / grid**3


def test_integrated_spot_is_proportional_to_the_number_of_cells():
    """The prefactor det N: ``integral F^2 = |det N| (0.315 pi)^(3/2)``, so a sheared crystal of the same volume
    scatters as much in total, and twice the cells scatter twice as much (module docstring of lattice)."""
    const = (0.315 * math.pi) ** 1.5
    # smallest eigenvalues near 5 or more: the spot lies well inside the cell (|dh| <= 1/2 holds > 6 sigma of F^2)
    for n in ((8.0, 9.0, 10.0, 1.0, -1.5, 0.8), (8.0, 8.0, 8.0, 0.0, 0.0, 0.0), (8.0, 8.0, 8.0, 2.0, -1.5, 1.0)):
        det = float(np.linalg.det(_matrix(n)))
        assert _integrated(n) == pytest.approx(det * const, rel=1e-6)
    sheared = (8.0, 8.0, 8.0, 2.0, -1.5, 1.0)
    assert _integrated(sheared) < _integrated((8.0, 8.0, 8.0, 0.0, 0.0, 0.0))  # shear at equal diagonal: fewer cells


def test_derivatives_match_finite_differences():
    rng = np.random.default_rng(11)
    dh = tuple(torch.tensor(rng.uniform(-0.4, 0.4, 7), dtype=DT, requires_grad=True) for _ in range(3))
    n = torch.tensor(SIZES, dtype=DT, requires_grad=True)
    fudge = torch.tensor(0.8, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c, m, f: anisotropic_gauss((a, b, c), m, f), (*dh, n, fudge))
    assert torch.autograd.gradgradcheck(lambda m: anisotropic_gauss(dh, m), (n,))


def test_shape_names_agree_between_config_and_physics():
    assert nb_config.SHAPES == lattice.SHAPES
    assert nb_config.ANISOTROPIC_SHAPE == lattice.ANISOTROPIC_SHAPE == "gauss_aniso"


SMALL = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -default_F 100 -lambda 1.0 -distance 40 -pixel 0.1 "
         "-detpixels 32 -mosaic 0.2 -mosaic_dom 2 -oversample 1 -gauss_aniso_xtal -Na 5 -Nb 5 -Nc 6")


def test_simulator_flags_and_overrides():
    """``-Nd -Ne -Nf`` set the canonical N_d N_e N_f; the overrides change the image; N_d = 0 is the diagonal case."""
    from nbtorch import Simulator, config_from_args

    sim = Simulator(config_from_args((SMALL + " -Nd 1 -Ne -0.5 -Nf 0.8").split()), compile=False, dtype=DT)
    p = sim.parameters_dict()
    assert (float(p["N_d"]), float(p["N_e"]), float(p["N_f"])) == (1.0, -0.5, 0.8)
    with torch.no_grad():
        img = sim()
        same = sim(N_d=torch.tensor(1.0, dtype=DT))
        diag = sim(N_d=torch.tensor(0.0, dtype=DT), N_e=torch.tensor(0.0, dtype=DT), N_f=torch.tensor(0.0, dtype=DT))
    assert float(img.max()) > 0 and torch.equal(img, same)
    assert not torch.allclose(img, diag)
    plain = Simulator(config_from_args(SMALL.split()), compile=False, dtype=DT)
    with torch.no_grad():
        assert torch.allclose(plain(), diag, rtol=1e-13, atol=0)


def test_forward_mode_jacobian_runs_through_the_shape():
    """The esd path (forward mode, :func:`torch.func.jacfwd`) goes through the eager hot loop for this shape:
    its columns equal reverse-mode gradients of the image."""
    from nbtorch import Simulator, config_from_args

    sim = Simulator(config_from_args((SMALL + " -Nd 1 -Ne -0.5 -Nf 0.8").split()), compile=False, dtype=DT)
    names = ("N_a", "N_d", "N_e", "N_f")
    theta = torch.tensor([5.0, 1.0, -0.5, 0.8], dtype=DT)
    weights = torch.rand(32, 32, dtype=DT, generator=torch.Generator().manual_seed(2))

    def image(t):
        return sim(**dict(zip(names, t.unbind(0))))

    J = torch.func.jacfwd(image)(theta)  # (32, 32, 4)
    t = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((image(t) * weights).sum(), t)
    assert torch.allclose((J * weights[..., None]).sum((0, 1)), g, rtol=1e-10, atol=1e-12)
    assert (g.abs() > 0).all()
