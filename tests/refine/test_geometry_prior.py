"""DIALS's geometry as a prior (refine.inputs.geometry_prior): the esd the indexed spots give the distance and beam
centre is the scatter of what a centroid fit of those spots returns.

One synthetic wedge of experiments.wedge_calibration (its document and reflections made from DIALS's frame alone):
30 draws of the spot finder's centroid scatter, each fitted for the cell, orientation, distance and beam centre
(refine.inputs.spot_start.align_to_spots, as DIALS's refinement fits them); the spread of the fitted distance and
beam centre against the esds spot_geometry_prior gives from one draw.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.wedge_calibration import CRYSTAL, START_DEG, WEDGES, document, reflections
from nbtorch import Simulator, config_from_args
from nbtorch.dials.geometry import experiment_flags
from nbtorch.io.dials import read_expt
from refine.inputs.geometry_prior import MIN_SCATTER, spot_geometry_prior
from refine.inputs.spot_start import align_to_spots
from refine.solver.plan import model_values

WEDGE = WEDGES[0]
SCATTER = 0.3


@pytest.fixture(scope="module")
def wedge(tmp_path_factory):
    path = tmp_path_factory.mktemp("geometry_prior") / "truth.expt"
    doc = document(WEDGE)
    path.write_text(json.dumps(doc))
    sim = Simulator(config_from_args(experiment_flags(read_expt(path), 0) + CRYSTAL.split()), compile=False)
    values = model_values(sim)
    hkl, xyz = reflections(doc, WEDGE)
    return sim, values, hkl.astype(float), xyz


def _noisy(xyz, rng, scatter=SCATTER):
    return xyz + rng.normal(scale=scatter, size=xyz.shape)


def test_the_prior_is_as_wide_as_the_spread_of_a_centroid_fit(wedge):
    sim, values, hkl, xyz = wedge
    rng = np.random.default_rng(5)
    fitted = []
    for _ in range(30):
        obs = _noisy(xyz, rng)
        fit = align_to_spots(sim, values, hkl, obs, START_DEG + obs[:, 2] * WEDGE.osc_deg, WEDGE.osc_deg,
                             WEDGE.symmetry, names=("cell", "orientation", "distance", "beam_centre"))
        fitted.append([fit.values[k] for k in ("distance", "beam_x", "beam_y")])
    spread = np.std(np.asarray(fitted), axis=0, ddof=1)
    obs = _noisy(xyz, rng)
    prior = spot_geometry_prior(sim, values, hkl, obs, START_DEG + obs[:, 2] * WEDGE.osc_deg, WEDGE.osc_deg,
                                WEDGE.symmetry)
    assert set(prior.priors) == {"distance", "beam_x", "beam_y"} and prior.n_spots == len(xyz)
    assert prior.scatter_px == pytest.approx(SCATTER, rel=0.35)
    for k, name in enumerate(("distance", "beam_x", "beam_y")):
        mean, esd = prior.priors[name]
        assert mean == values[name]  # centred on DIALS's value
        assert 0.6 < esd / spread[k] < 1.6, (name, esd, spread[k])


def test_the_prior_narrows_with_the_scatter_and_has_a_floor(wedge):
    sim, values, hkl, xyz = wedge
    phi = START_DEG + xyz[:, 2] * WEDGE.osc_deg
    rng = np.random.default_rng(1)
    noise = rng.normal(size=xyz.shape)
    wide = spot_geometry_prior(sim, values, hkl, xyz + 0.6 * noise, phi, WEDGE.osc_deg, WEDGE.symmetry)
    narrow = spot_geometry_prior(sim, values, hkl, xyz + 0.3 * noise, phi, WEDGE.osc_deg, WEDGE.symmetry)
    ratio = wide.priors["distance"][1] / narrow.priors["distance"][1]
    # twice the scatter: about twice the esd (the observed frames also move the predicted positions: 1.5 here)
    assert 1.3 < ratio < 2.3, ratio
    exact = spot_geometry_prior(sim, values, hkl, xyz, phi, WEDGE.osc_deg, WEDGE.symmetry)  # ideal centroids
    assert exact.scatter_px == MIN_SCATTER and exact.scatter_frames == MIN_SCATTER
    assert exact.priors["distance"][1] > 0
    only = spot_geometry_prior(sim, values, hkl, xyz + 0.3 * noise, phi, WEDGE.osc_deg, WEDGE.symmetry,
                               names=("distance",))
    assert set(only.priors) == {"distance"}
