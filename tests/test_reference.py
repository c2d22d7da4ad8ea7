"""The vectorised kernel against the slow loop-based reference (values and gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.reference import reference_pixel

BASE = "-cell 70 80 90 75 85 95 -misset 10 20 30 -N 4 -lambda 1 -default_F 100 -distance 60 -detpixels 24 -pixel 0.8"
CONFIGS = {
    "plain": "",
    "sampling": "-oversample 2 -mosaic 0.4 -mosaic_dom 3 -phi 1 -osc 0.6 -phisteps 2 -divergence 2 -divsteps 2 -dispersion 1 -dispsteps 2",
    "polar_sensor": "-polar 0.7 -detector_thick 200 -detector_abs 150 -thicksteps 3",
    "xds_rotated": "-xds -ORGX 9 -ORGY 14 -detector_rotx 2 -twotheta 5",
    "round": "-round_xtal -oversample 2",
    "gauss": "-gauss_xtal",
    "tophat": "-tophat_spots",
    "water_dmin": "-water 50 -dmin 3 -point_pixel",
}
MODES = {"spec": [], "c_parity": ["-c_parity"]}


def _pixels(img: torch.Tensor, n: int = 5) -> list[tuple[int, int]]:
    """The brightest pixels plus a dim corner: where the physics is non-trivial."""
    flat = img.flatten().argsort(descending=True)[: n - 1]
    pts = [divmod(int(i), img.shape[1]) for i in flat]
    return pts + [(0, 0)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CONFIGS)
def test_kernel_matches_reference(name, mode):
    sim = Simulator(config_from_args((BASE + " " + CONFIGS[name]).split() + MODES[mode]), dtype=torch.float64, compile=False)
    with torch.no_grad():
        img = sim()
    assert img.max() > 0
    for j, i in _pixels(img):
        ref = reference_pixel(sim, i, j)
        got = float(img[j, i])
        assert got == pytest.approx(ref, rel=1e-9, abs=1e-12 * float(img.max())), f"{name}/{mode} pixel ({j},{i})"


def test_reference_gradient_matches_autograd():
    """d(pixel)/d(cell_a) by finite differences of the reference == autograd of the kernel."""
    sim = Simulator(config_from_args(BASE.split()), dtype=torch.float64, compile=False)
    with torch.no_grad():
        img = sim()
    j, i = _pixels(img, 2)[0]
    x = torch.tensor(70.0, dtype=torch.float64, requires_grad=True)
    sim(cell_a=x)[j, i].backward()
    h = 1e-5
    fd = (reference_pixel(sim, i, j, cell_a=torch.tensor(70.0 + h, dtype=torch.float64)) - reference_pixel(sim, i, j, cell_a=torch.tensor(70.0 - h, dtype=torch.float64))) / (2 * h)
    assert float(x.grad) != 0
    assert float(x.grad) == pytest.approx(fd, rel=1e-5)
