"""Does the refined cell still move with the mosaic domain count? (refine.quality.domain_count)

The joint step's elimination of the images' own names is the dense Newton step's shared part; a refinement whose
model samples a wide mosaic of a sharp crystal with 2 domains is told that its cell moves at 4 (warning and
``mosaic_domains`` in the result), one with 16 domains is not.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from refine import refine
from refine.output.report import write_outputs
from refine.quality.domain_count import MAX_SHIFT_ESD, reduced_terms, secant_factor, shared_shift, single_shift

SHARP = ("-cell 40 50 60 90 90 90 -misset 12 25 40 -N 10 -lambda 1.0 -default_F 40 -distance 60 -detpixels 48 "
         "-pixel 0.2 -oversample 1 -mosaic 0.3 -nopolar")


def test_secant_finds_the_minimum_of_a_quadratic_along_the_step():
    # L(t) = (t - 0.6)^2 along d: slopes -1.2 at 0 and 0.8 at 1
    assert secant_factor(-1.2, 0.8) == pytest.approx(0.6)
    assert secant_factor(-1.0, -2.0) == 1.0  # no positive curvature: the Fisher step as it is
    assert secant_factor(-10.0, -9.0) == 4.0  # capped


def test_shared_step_is_the_dense_newton_steps_shared_part():
    rng = np.random.default_rng(3)
    S, K, n = 3, 2, 4
    P = S + n * K
    F = np.zeros((P, P))
    blocks, grads = [], []
    for i in range(n):  # an arrowhead: each image sees the shared names and its own
        J = rng.normal(size=(20, S + K))
        Fi = J.T @ J
        gi = rng.normal(size=S + K)
        idx = list(range(S)) + list(range(S + i * K, S + (i + 1) * K))
        F[np.ix_(idx, idx)] += Fi
        blocks.append(torch.tensor(Fi))
        grads.append((idx, gi))
    g = np.zeros(P)
    for idx, gi in grads:
        g[idx] += gi
    dense = -np.linalg.solve(F, g)[:S]
    terms = [reduced_terms(Fi, torch.tensor(gi), S) for Fi, (_, gi) in zip(blocks, grads)]
    assert np.allclose(shared_shift(terms).numpy(), dense, rtol=1e-10, atol=1e-12)
    assert np.allclose(single_shift(torch.tensor(F), torch.tensor(g)).numpy(), -np.linalg.solve(F, g), rtol=1e-10)


def _fit(domains: int, observed: np.ndarray):
    sim = Simulator(config_from_args(f"{SHARP} -mosaic_dom {domains}".split()), compile=False)
    return refine(sim, observed, free=["scale", "background", "cell", "orientation"], symmetry="orthorhombic",
                  stages=None, progress=False, start={"scale": 1.0, "background": 2.0})


@pytest.fixture(scope="module")
def observed():
    truth = Simulator(config_from_args(f"{SHARP} -mosaic_dom 200".split()), compile=False)
    image = truth().detach().numpy() + 2.0
    return np.random.default_rng(0).poisson(image).astype(np.float64)


def test_too_few_domains_warns_and_a_converged_count_does_not(observed, tmp_path):
    few = _fit(2, observed)
    check = few.mosaic_domains
    assert check["domains"] == 2 and check["check_domains"] == 4
    assert max(abs(v) for v in check["shift_esd"].values()) > MAX_SHIFT_ESD
    assert any("moves with the mosaic domain count" in w for w in few.warnings)
    write_outputs(few, str(tmp_path / "result.h5"), str(tmp_path / "result.json"), {})
    assert json.loads((tmp_path / "result.json").read_text())["mosaic_domains"]["shift_esd"] == \
        pytest.approx(check["shift_esd"])
    assert 0.5 < check["secant"] < 2  # the model explains this image: the Fisher step is nearly the whole way
    four = _fit(4, observed)  # the step predicted the move to 4 domains
    for name, shift in check["shift"].items():
        assert four.params[name] - few.params[name] == pytest.approx(shift, rel=0.3, abs=0.2 * four.esds[name])
    many = _fit(16, observed)
    assert max(abs(v) for v in many.mosaic_domains["shift_esd"].values()) < 0.5 * MAX_SHIFT_ESD
    assert not any("mosaic domain count" in w for w in many.warnings)
