"""Pilatus and Eiger images as modules (nbtorch.io.modules) and module panels of one detector (module_configs)."""

from __future__ import annotations

import bz2
from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from nbtorch.io.modules import detector_family, module_grid, split_modules
from nbtorch.geometry.panels import module_configs

THAUMATIN = Path(__file__).resolve().parents[1].parent / "shared" / "real" / "thaumatin_i24_still" / "thau_3_2_0003.cbf.bz2"


def test_module_grids_of_the_known_detectors():
    six = module_grid("pilatus", (2527, 2463))
    assert len(six) == 60 and six[0] == (0, 0, 487, 195) and six[4] == (1976, 0, 487, 195)
    assert six[-1] == (1976, 2332, 487, 195) and six[-1][0] + 487 == 2463 and six[-1][1] + 195 == 2527
    assert len(module_grid("pilatus", (1679, 1475))) == 24  # 2M: 3 x 8
    sixteen = module_grid("eiger", (4371, 4150))
    assert len(sixteen) == 32 and sixteen[-1] == (3120, 3857, 1030, 514)
    assert len(module_grid("eiger", (3269, 3110))) == 18  # 9M: 3 x 6
    with pytest.raises(InputError, match="not a whole number of pilatus modules"):
        module_grid("pilatus", (2527, 2464))


def test_family_from_the_header():
    assert detector_family("# Detector: PILATUS3 6M, S/N 60-0119", (2527, 2463)) == "pilatus"
    assert detector_family({"description": "Dectris EIGER2 XE 16M"}, (4371, 4150)) == "eiger"
    with pytest.raises(InputError, match="the header names no detector of modules"):
        detector_family("# Detector: ADSC Q315", (3072, 3072))
    with pytest.raises(InputError, match=r"2463 x 2500 pixels \(fast x slow\) is not a whole number of pilatus"):
        detector_family("# Detector: PILATUS3 6M", (2500, 2463))


@pytest.mark.skipif(not THAUMATIN.is_file(), reason="shared/real/thaumatin_i24_still is not beside the checkout")
def test_the_thaumatin_pilatus_gaps_are_exactly_the_gaps_of_its_60_modules():
    from nbtorch.io.cbf import read_cbf

    path = Path("/tmp") / f"thau_modules_{np.random.default_rng().integers(1 << 30)}.cbf"
    path.write_bytes(bz2.decompress(THAUMATIN.read_bytes()))
    try:
        image, header = read_cbf(str(path))
    finally:
        path.unlink()
    family = detector_family(header, image.shape)
    modules = split_modules(image, family)
    assert family == "pilatus" and len(modules) == 60
    inside = np.zeros(image.shape, dtype=bool)
    for x0, y0, w, h in module_grid(family, image.shape):
        inside[y0:y0 + h, x0:x0 + w] = True
    assert (image[~inside] == -1).all() and (~inside).sum() == 526101  # the README's count of -1 pixels
    assert (np.concatenate([m.ravel() for m in modules]) >= -2).all()
    assert sum(int((m == -1).sum()) for m in modules) == 0


ARGS = "-cell 70 80 90 75 85 95 -misset 10 20 30 -N 5 -lambda 1.0 -default_F 100 -oversample 1 -pixel 0.1 " \
       "-detpixels_f 60 -detpixels_s 50"
MODULES = [(0, 0, 20, 20), (25, 0, 35, 20), (0, 30, 20, 20), (25, 30, 35, 20)]


@pytest.mark.parametrize("detector", ["-distance 60 -detector_rotz 3 -twotheta 5",
                                      "-xds -distance 60 -ORGX 20 -ORGY 30 -detector_rotx 2",
                                      "-adxv -distance 60",
                                      "-fdet_vector 0 0.1 1 -sdet_vector 0 -1 0 -distance 60 -pivot sample"])
def test_module_panels_are_the_one_panels_pixels(detector: str):
    argv = ARGS.split() + detector.split()
    whole, _ = Simulator(config_from_args(argv)).render()
    sim = Simulator.from_panels(module_configs(argv, MODULES))
    image, _ = sim.render()
    assert float(whole.max()) > 0
    for i, (x0, y0, w, h) in enumerate(MODULES):
        block = sim.panel_layout.panel_image(image, i)
        assert torch.allclose(block, whole[y0:y0 + h, x0:x0 + w], rtol=1e-9, atol=1e-12 * float(whole.max())), i
    with pytest.raises(InputError, match="lies outside the 60 x 50 detector"):
        module_configs(argv, [(50, 0, 20, 20)])
