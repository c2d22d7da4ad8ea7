"""Every canonical parameter: autograd derivative == central finite difference, on a non-trivial image.

The scalar is a fixed random weighting of the image (so no derivative can pass as 0 == 0);
each test also asserts that the image has Bragg spots and that the derivative is not zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import PARAMETER_NAMES, Simulator, config_from_args

ARGS = (
    "-cell 70 80 90 80 95 100 -misset 10 20 30 -N 4 -lambda 1.2 -default_F 100 -distance 60 "
    "-detpixels 40 -pixel 0.5 -oversample 1 -mosaic 0.4 -mosaic_dom 3 -mosaic_seed 5 "
    "-phi 3 -osc 0.4 -phisteps 2 -polar 0.6 -detector_rotx 1 -detector_roty 2 -detector_rotz 3 -twotheta 4"
)
STEPS = {
    "cell_a": 1e-4, "cell_b": 1e-4, "cell_c": 1e-4, "cell_alpha": 1e-4, "cell_beta": 1e-4, "cell_gamma": 1e-4,
    "misset_x": 1e-4, "misset_y": 1e-4, "misset_z": 1e-4, "phi0": 1e-4, "mosaic_spread": 1e-4,
    "N_a": 1e-5, "N_b": 1e-5, "N_c": 1e-5, "distance": 1e-4, "beam_x": 1e-4, "beam_y": 1e-4,
    "detector_rotx": 1e-4, "detector_roty": 1e-4, "detector_rotz": 1e-4, "twotheta": 1e-4,
    "wavelength": 1e-7, "fluence": 1e20, "polarization": 1e-4, "default_F": 1e-3,
}


@pytest.fixture(scope="module")
def sim():
    return Simulator(config_from_args(ARGS.split()), dtype=torch.float64)


@pytest.fixture(scope="module")
def weights(sim):
    gen = torch.Generator().manual_seed(0)
    return torch.rand(sim.shape, generator=gen, dtype=torch.float64)


def test_image_is_not_trivial(sim):
    img = sim().detach().numpy()
    peak = img.max()
    assert peak > 0
    spots = (img > 0.1 * peak).sum()
    assert spots >= 5, f"only {spots} bright pixels"


@pytest.mark.parametrize("name", PARAMETER_NAMES)
def test_gradient_matches_finite_difference(sim, weights, name):
    base = float(getattr(sim, name))
    x = torch.tensor(base, dtype=torch.float64, requires_grad=True)
    loss = (sim(**{name: x}) * weights).sum()
    (grad,) = torch.autograd.grad(loss, x)
    h = STEPS[name]
    with torch.no_grad():
        up = (sim(**{name: torch.tensor(base + h, dtype=torch.float64)}) * weights).sum()
        dn = (sim(**{name: torch.tensor(base - h, dtype=torch.float64)}) * weights).sum()
    fd = float((up - dn) / (2 * h))
    g = float(grad)
    assert np.isfinite(g)
    assert g != 0.0, f"{name}: zero gradient"
    assert abs(g - fd) <= 1e-4 * abs(fd) + 1e-9 * abs(float(loss.detach())) / max(abs(base), 1.0), f"{name}: autograd {g:.8g} vs FD {fd:.8g}"


def test_structure_factor_table_gradient(tmp_path):
    """d(sum image)/dF for the nearest-neighbour table: finite, non-zero, equal to a finite difference."""
    rng = np.random.default_rng(1)
    hkl = tmp_path / "P1.hkl"
    lines = [f"{h} {k} {l} {rng.uniform(20, 80):.3f}" for h in range(-6, 7) for k in range(-6, 7) for l in range(-6, 7)]
    hkl.write_text("\n".join(lines) + "\n")
    s = Simulator(config_from_args(ARGS.split() + ["-hkl", str(hkl)]), dtype=torch.float64)
    grid = s.F_grid.detach().clone().requires_grad_(True)
    s(F_grid=grid).sum().backward()
    g = grid.grad
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    idx = tuple(int(i) for i in torch.nonzero(g.abs() == g.abs().max())[0])
    with torch.no_grad():
        bumped = grid.detach().clone()
        bumped[idx] += 1e-3
        fd = (s(F_grid=bumped).sum() - s(F_grid=grid.detach()).sum()) / 1e-3
    assert abs(float(g[idx]) - float(fd)) <= 1e-4 * abs(float(fd))
