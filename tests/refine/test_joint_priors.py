"""Gaussian priors on a joint run's shared names (refine.many.priors; refine_joint(priors=...)).

The four 32 x 32 stills of tests/refine/test_joint.py: a prior as wide as the cell's own esd halves its variance
(the marginal of a Gaussian: precisions add), a narrow prior holds the name at its mean, the loss holds the prior's
term once, and a prior on a name that is not shared is refused.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from nbtorch.errors import InputError
from refine.fitting.parameters import SYMMETRIES
from refine.inputs.problems import make_stills
from refine.many.joint import refine_joint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from joint_stills import image_start  # noqa: E402

CELL = SYMMETRIES["orthorhombic"]


@pytest.fixture(scope="module")
def stills(tmp_path_factory):
    torch.set_num_threads(1)
    return make_stills("orthorhombic_xds", 4, 32, seed=1, directory=tmp_path_factory.mktemp("prior_problems"))


def _joint(stills, **kw):
    return refine_joint([p.simulator() for p in stills], [p.observed for p in stills], symmetry=stills[0].symmetry,
                        start={k: stills[0].start[k] for k in CELL}, image_starts=[image_start(p) for p in stills], **kw)


@pytest.fixture(scope="module")
def free(stills):
    torch.set_num_threads(1)
    return _joint(stills)


def test_a_prior_adds_its_information_to_the_shared_name(stills, free):
    esd = free.esds_by_kind["fisher"]["shared"]["cell_a"]
    assert math.isfinite(esd) and esd > 0
    mean = free.shared["cell_a"]
    with_prior = _joint(stills, priors={"cell_a": (mean, esd)})
    assert with_prior.status.ok
    # the marginal of cell_a: its precision plus the prior's, 1 / esd^2 + 1 / esd^2
    assert with_prior.esds_by_kind["fisher"]["shared"]["cell_a"] == pytest.approx(esd / math.sqrt(2), rel=0.05)
    assert with_prior.shared["cell_a"] == pytest.approx(mean, abs=0.2 * esd)
    # the prior's term is in the loss once, beside the images' losses
    term = 0.5 * ((with_prior.shared["cell_a"] - mean) / esd) ** 2
    assert with_prior.loss_final == pytest.approx(sum(with_prior.image_losses) + term, rel=1e-9, abs=1e-9)


def test_a_narrow_prior_holds_the_name_at_its_mean(stills, free):
    esd = free.esds_by_kind["fisher"]["shared"]["cell_a"]
    target = free.shared["cell_a"] + 5 * esd
    held = _joint(stills, priors={"cell_a": (target, esd / 100)})
    assert held.status.ok
    assert held.shared["cell_a"] == pytest.approx(target, abs=0.05 * esd)
    assert held.esds_by_kind["fisher"]["shared"]["cell_a"] < esd / 50
    assert held.loss_final > sum(held.image_losses)  # the prior's term, pulled 5 esds


@pytest.mark.parametrize("priors, message", [
    ({"distance": (100.0, 1.0)}, "distance not among the shared names"),
    ({"scale": (1.0, 0.1)}, "scale not among the shared names"),
    ({"cell_a": (100.0, 0.0)}, "sigma must be finite and > 0"),
])
def test_priors_on_names_that_are_not_shared_are_refused(stills, priors, message):
    with pytest.raises(InputError, match=message):
        _joint(stills, priors=priors)
