"""nbtorch.rules.resolve: resolve composes frozen per-concern pieces; Setup reads their fields through."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nbtorch import config_from_args
from nbtorch.rules.resolve import (
    CrystalSetup, DetectorSetup, SamplingSetup, SensorSetup, Setup, StructureFactorSetup, resolve, resolve_crystal,
    resolve_detector, resolve_sampling, resolve_sensor, resolve_structure_factors,
)

ARGS = ("-cell 50 60 70 90 95 90 -N 4 -lambda 1.2 -default_F 10 -distance 90 -detpixels_f 30 -detpixels_s 20 "
        "-xds -ORGX 12 -ORGY 9 -mosaic 0.4 -mosaic_dom 3 -phisteps 2 -osc 0.5 -detector_thick 100 -oversample 2")
PIECES = {"detector": DetectorSetup, "crystal": CrystalSetup, "sampling": SamplingSetup, "sensor": SensorSetup,
          "structure_factors": StructureFactorSetup}


@pytest.fixture(scope="module")
def cfg():
    return config_from_args(ARGS.split())


def test_pieces_are_frozen_and_read_through(cfg):
    s = resolve(cfg)
    for name, cls in PIECES.items():
        piece = getattr(s, name)
        assert type(piece) is cls and dataclasses.is_dataclass(piece)
        for f in dataclasses.fields(piece):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(piece, f.name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.params = {}
    with pytest.raises(AttributeError):
        s.pixel_m = 1.0  # a read-through attribute, not a field
    assert (s.pixel_m, s.fpixels, s.spixels, s.convention, s.pivot) == (1e-4, 30, 20, "xds", "sample")
    assert s.roi == (0, 29, 0, 19) and s.oversample == 2 and s.phisteps == 2 and s.thicksteps == 2
    assert s.pixel_m is s.detector.pixel_m and s.incident is s.sampling.incident
    assert s.F_grid is None and s.interpolate is False and s.has_thickness
    assert s.samples_per_pixel == 2 * 2 * 2 and s.evaluations_per_pixel == 8 * 2 * 3
    assert s.steps == 1 * 2 * 3 * 2 * 2


def test_builders_alone_match_resolve(cfg):
    s = resolve(cfg)
    detector = resolve_detector(cfg)
    crystal = resolve_crystal(cfg, False)
    sampling = resolve_sampling(cfg, False, detector, crystal)
    assert detector.beam_x_m * 1000 == s.params["beam_x"] and detector.distance_m * 1000 == s.params["distance"]
    assert np.array_equal(crystal.cell, [s.params[n] for n in ("cell_a", "cell_b", "cell_c", "cell_alpha",
                                                               "cell_beta", "cell_gamma")])
    assert np.array_equal(sampling.incident, s.incident) and sampling.steps == s.steps
    assert resolve_sensor(cfg, False, sampling) == s.sensor
    assert resolve_structure_factors(cfg, crystal.n_cells, detector).dmin_A == s.dmin_A


def test_replace_pixel_mask_keeps_the_pieces(cfg):
    s = resolve(cfg)
    mask = np.zeros((20, 30), dtype=bool)
    t = dataclasses.replace(s, pixel_mask=mask)
    assert isinstance(t, Setup) and t.pixel_mask is mask and s.pixel_mask is None
    assert t.detector is s.detector and t.sampling is s.sampling and t.params is s.params
