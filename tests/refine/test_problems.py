"""The synthetic problem bank: deterministic, perturbed as documented, simulator args that parse."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nbtorch.cli.args import config_from_args
from refine import PROBLEMS, make_problem
from refine.fitting.parameters import BASE_NAMES, SYMMETRIES
from refine.inputs.problems import PEDESTAL, PERTURBATION, misorientation_deg

MISSET = ("misset_x", "misset_y", "misset_z")


@pytest.mark.parametrize("name", PROBLEMS)
def test_problem_definition(problem_cache, name):
    p = problem_cache(name, 64)
    assert p.name == name and p.size == 64 and p.observed.shape == (64, 64)
    assert set(p.truth) == set(p.start) == set(BASE_NAMES)
    assert p.symmetry in SYMMETRIES
    config_from_args(list(p.args))  # the starting model's command line parses
    for n in ("cell_a", "cell_b", "cell_c"):
        assert p.start[n] == pytest.approx(p.truth[n] * PERTURBATION["cell_length_factor"])
    for n in ("cell_alpha", "cell_beta", "cell_gamma"):
        shift = PERTURBATION["cell_angle_deg"] if n in SYMMETRIES[p.symmetry] else 0.0
        assert p.start[n] - p.truth[n] == pytest.approx(shift)
    assert misorientation_deg([p.start[k] for k in MISSET], [p.truth[k] for k in MISSET]) == pytest.approx(0.3)
    pixel = 0.1
    assert (p.start["beam_x"] - p.truth["beam_x"]) / pixel == pytest.approx(2.0)
    assert (p.start["beam_y"] - p.truth["beam_y"]) / pixel == pytest.approx(2.0)
    assert p.start["mosaic_spread"] == pytest.approx(2 * p.truth["mosaic_spread"])
    assert p.start["N_a"] == pytest.approx(0.75 * p.truth["N_a"])
    assert p.start["scale"] == 3.0 and p.truth["scale"] == 1.0
    assert p.truth["background"] == 45.0 and p.observed.min() >= PEDESTAL
    assert np.all(p.observed == np.round(p.observed))
    assert ("distance" in p.fixed) != (name == "cubic_wide")


def test_problems_are_deterministic(tmp_path, problem_cache):
    a = problem_cache("cubic_mosflm", 64)
    b = make_problem("cubic_mosflm", 64, directory=tmp_path)
    assert np.array_equal(a.observed, b.observed) and a.start == b.start
    c = make_problem("cubic_mosflm", 64, seed=99, directory=tmp_path)
    assert not np.array_equal(a.observed, c.observed)
    with pytest.raises(ValueError, match="unknown name"):
        make_problem("cubic", 64)
    with pytest.raises(ValueError, match="size"):
        make_problem("cubic_mosflm", 8)
    assert math.isfinite(float(a.observed.sum()))
