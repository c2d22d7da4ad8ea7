"""A detector of several panels rendered in one call (nbtorch.geometry.panels, Simulator.from_panels)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from golden import GOLDEN, assert_parity, golden_args, golden_image, needs_golden
from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from nbtorch.geometry.panels import PANEL_GEOMETRY_NAMES, panel_parameter, split_panel_parameter

BASE = "-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1.0 -default_F 100 -oversample 1".split()
#: three panels of different sizes, pivots and rotations, one with a -roi (CUSTOM vectors: one lab frame)
PANELS = [
    "-detpixels_f 40 -detpixels_s 30 -pixel 0.1 -distance 100 -Xbeam 2 -Ybeam 1.5",
    "-detpixels_f 32 -detpixels_s 20 -pixel 0.1 -distance 105 -Xbeam -1 -Ybeam 2 -detector_rotz 5 -roi 2 29 1 17",
    "-fdet_vector 0 0.2 1 -sdet_vector 0 -1 0 -detpixels_f 36 -detpixels_s 30 -pixel 0.1 -distance 98 -Xbeam 1 "
    "-Ybeam 4 -pivot sample -detector_rotx 3 -twotheta 2",
]


def _configs(panels=PANELS, extra=()):
    return [config_from_args(BASE + list(extra) + p.split()) for p in panels]


def test_each_panel_is_its_single_panel_render_exactly():
    cfgs = _configs()
    sim = Simulator.from_panels(cfgs, names=["a", "b", "c"])
    image, _ = sim.render()
    layout = sim.panel_layout
    assert tuple(image.shape) == (3 * 30, 40) == layout.shape
    for i, cfg in enumerate(cfgs):
        single, _ = Simulator(cfg).render()
        block = layout.panel_image(image, i)
        x0, x1, y0, y1 = Simulator(cfg).setup.roi
        full = torch.zeros_like(block)
        full[y0:y1 + 1, x0:x1 + 1] = single
        assert single.abs().max() > 0
        assert torch.equal(block, full), f"panel {i}"
    # block pixels outside a smaller panel are never computed (exactly 0)
    assert float(image[30:60, 32:].abs().max()) == 0.0
    assert layout.mask is not None and not layout.mask[30:60, 32:].any()


def test_render_pixels_and_restricted_see_the_panels():
    sim = Simulator.from_panels(_configs())
    image, _ = sim.render()
    keep = np.zeros(sim.shape, dtype=bool)
    keep[5:70:3, ::2] = True
    values, index, _ = sim.restricted(keep).render_pixels()
    flat = image.reshape(-1)
    assert torch.equal(values, flat[index])
    assert torch.equal(sim(), image)


def test_panels_of_different_pixel_sizes():
    panels = [PANELS[0], "-detpixels_f 30 -detpixels_s 24 -pixel 0.172 -distance 120 -Xbeam 3 -Ybeam 2"]
    cfgs = _configs(panels)
    sim = Simulator.from_panels(cfgs)
    image, _ = sim.render()
    for i, cfg in enumerate(cfgs):
        single, _ = Simulator(cfg).render()
        assert torch.equal(sim.panel_layout.panel_image(image, i), single), f"panel {i}"


def test_names_extend_the_detector_names():
    assert PANEL_GEOMETRY_NAMES == ("distance", "beam_x", "beam_y", "detector_rotx", "detector_roty",
                                    "detector_rotz", "twotheta")
    assert panel_parameter("beam_x", 12) == "beam_x_p12"
    assert split_panel_parameter("beam_x_p12") == ("beam_x", 12)
    assert split_panel_parameter("cell_a_p1") is None and split_panel_parameter("distance_p01") is None
    sim = Simulator.from_panels(_configs())
    p = sim.parameters_dict()
    assert float(p["distance_p1"]) == 105.0 and float(p["detector_rotz_p1"]) == 5.0
    with pytest.raises(InputError, match="distance_p0"):
        sim.render(distance=101.0)
    with pytest.raises(InputError, match="unknown parameter"):
        sim.render(distance_p7=101.0)


def test_overriding_one_panel_moves_only_that_panel():
    sim = Simulator.from_panels(_configs())
    layout = sim.panel_layout
    before, _ = sim.render()
    after, _ = sim.render(beam_x_p1=torch.tensor(-0.8, dtype=torch.float64))
    assert torch.equal(layout.panel_image(before, 0), layout.panel_image(after, 0))
    assert torch.equal(layout.panel_image(before, 2), layout.panel_image(after, 2))
    assert not torch.equal(layout.panel_image(before, 1), layout.panel_image(after, 1))
    moved = Simulator(config_from_args(BASE + PANELS[1].replace("-Xbeam -1", "-Xbeam -0.8").split())).render()[0]
    x0, x1, y0, y1 = 2, 29, 1, 17
    assert torch.allclose(layout.panel_image(after, 1)[y0:y1 + 1, x0:x1 + 1], moved, rtol=1e-12, atol=0)


GRAD_NAMES = ("distance_p0", "beam_x_p0", "beam_y_p1", "detector_rotz_p1", "detector_rotx_p2", "twotheta_p2",
              "distance_p2")


def test_gradients_of_every_panel_match_finite_differences():
    sim = Simulator.from_panels(_configs(extra=["-N", "3"]))
    p0 = {n: float(v) for n, v in sim.parameters_dict().items() if n in GRAD_NAMES}
    weights = torch.linspace(0.5, 1.5, sim.shape[0] * sim.shape[1], dtype=torch.float64).reshape(sim.shape)

    def loss(**values):
        image, _ = sim.render(**values)
        return (image * weights).sum()

    leaves = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in p0.items()}
    value = loss(**leaves)
    assert float(value.detach()) > 0
    value.backward()
    for name in GRAD_NAMES:
        h = 1e-4  # mm or deg
        up = float(loss(**{name: torch.tensor(p0[name] + h, dtype=torch.float64)}))
        down = float(loss(**{name: torch.tensor(p0[name] - h, dtype=torch.float64)}))
        fd = (up - down) / (2 * h)
        ad = float(leaves[name].grad)
        assert abs(fd) > 1e-6 * abs(float(value.detach())), f"{name}: the loss does not depend on it"
        assert abs(ad - fd) <= 1e-4 * abs(fd) + 1e-9, f"{name}: autograd {ad:.8g} vs finite differences {fd:.8g}"


def test_panels_must_share_the_crystal_and_the_beam():
    cfgs = _configs()
    cfgs[2] = config_from_args(BASE + ["-lambda", "1.1"] + PANELS[2].split())
    with pytest.raises(InputError, match="panel 2: wavelength 1.1 differs from panel 0's 1"):
        Simulator.from_panels(cfgs)
    xds = config_from_args(BASE + "-xds -detpixels 20 -distance 100".split())
    with pytest.raises(InputError, match="panel 1: its beam direction"):
        Simulator.from_panels([cfgs[0], xds])
    curved = config_from_args(BASE + "-detpixels 20 -distance 100 -curved_det".split())
    with pytest.raises(InputError, match="panel 1: -curved_det"):
        Simulator.from_panels([cfgs[0], curved])
    with pytest.raises(InputError, match="no panel"):
        Simulator.from_panels([])


#: golden cases of one crystal and beam seen by four differently placed detectors
GOLDEN_PANELS = ("triclinic_misset", "detector_rotations_pivot_beam", "detector_rotations_custom_pivot_beam",
                 "detector_rotations_custom_pivot_sample")


@needs_golden
def test_each_panel_matches_its_c_golden():
    """Four C runs as four panels of one detector: every panel within the C-parity acceptance of its golden."""
    roi = ["-roi", "96", "191", "64", "159"]  # a 96 x 96 window with spots, to keep the test fast
    old = os.getcwd()
    os.chdir(GOLDEN / GOLDEN_PANELS[0])
    try:
        cfgs = [config_from_args(golden_args(case) + ["-c_parity"] + roi) for case in GOLDEN_PANELS]
    finally:
        os.chdir(old)
    sim = Simulator.from_panels(cfgs, names=list(GOLDEN_PANELS))
    with torch.no_grad():
        image = sim().double().numpy()
    for i, case in enumerate(GOLDEN_PANELS):
        ref = golden_image(case, (256, 256)).astype(np.float64)[64:160, 96:192]
        block = sim.panel_layout.panel_image(image, i)[64:160, 96:192]
        assert_parity(block, ref, case)


@pytest.mark.slow
def test_compiled_panels_match_eager():
    """The compiled multi-panel kernel (the panel gather inside the compiled first stage) gives the eager pixels
    (float64, to rounding) and the same gradients of a panel's geometry."""
    cfgs = _configs()
    eager = Simulator.from_panels(cfgs, compile=False)
    compiled = Simulator.from_panels(cfgs, compile=True)
    a, _ = eager.render()
    b, _ = compiled.render()
    assert compiled.compile_mode == "compiled"
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12 * float(a.max()))
    grads = []
    for sim in (eager, compiled):
        d = torch.tensor(float(sim.parameters_dict()["distance_p2"]), dtype=torch.float64, requires_grad=True)
        image, _ = sim.render(distance_p2=d)
        image.sum().backward()
        grads.append(float(d.grad))
    assert grads[1] == pytest.approx(grads[0], rel=1e-8)
