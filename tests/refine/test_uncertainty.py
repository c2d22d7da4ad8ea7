"""Esds: the Jacobian behind the Fisher matrix, its inverse, derived esds, preconditioners, and calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refine.fitting.objective import ImageObjective, make_view, poisson_deviance
from refine.fitting.parameters import ParameterMap, ParameterSpace
from refine.solver.precondition import make_preconditioner
from refine.quality.uncertainty import estimate_uncertainties, fisher_information

F64 = torch.float64
FREE = ("scale", "background", "orientation", "cell", "beam_centre", "mosaic")


def _setup(problem, free=FREE, values=None):
    sim = problem.simulator()
    values = values or problem.truth
    space = ParameterSpace(symmetry=problem.symmetry, pixel_mm=sim.setup.pixel_m * 1e3)
    pmap = ParameterMap(space, values, space.expand(free))
    obs = torch.as_tensor(problem.observed)
    view = make_view(sim, values, torch.ones(sim.shape, dtype=torch.bool))
    return sim, pmap, ImageObjective(sim, obs, view)


def test_fisher_matches_finite_differences(problem_cache):
    problem = problem_cache("tetragonal_mosflm", 32)
    sim, pmap, obj = _setup(problem)
    theta = torch.stack(list(pmap.physical(pmap.raw0()).values())).detach()
    names = pmap.names

    def model(th):
        return obj.model(pmap.expand({n: th[i] for i, n in enumerate(names)}))

    def weights(mu, block):
        return 1.0 / mu

    F = fisher_information(lambda th, b: model(th), theta, [(0, 0)], weights)
    with torch.no_grad():
        mu = model(theta)
        cols = []
        for i in range(len(names)):
            h = 1e-6 * max(1.0, abs(float(theta[i])))
            e = torch.zeros_like(theta)
            e[i] = h
            cols.append(((model(theta + e) - model(theta - e)) / (2 * h)).reshape(-1))
        J = torch.stack(cols, -1)
        F_fd = J.T @ (J / mu.reshape(-1, 1))
    scale = torch.sqrt(torch.outer(torch.diagonal(F_fd), torch.diagonal(F_fd)))
    assert torch.allclose(F / scale, F_fd / scale, atol=1e-5)


def test_esds_row_blocks_and_derived_values(problem_cache):
    problem = problem_cache("tetragonal_mosflm", 32)
    sim, pmap, obj = _setup(problem)
    whole = estimate_uncertainties(obj, pmap, pmap.raw0(), rows_per_block=1000)
    blocks = estimate_uncertainties(obj, pmap, pmap.raw0(), rows_per_block=7)
    assert np.allclose(whole.fisher, blocks.fisher, rtol=1e-10)
    assert np.allclose(whole.esds, blocks.esds, rtol=1e-8)
    assert whole.names == pmap.names and np.all(whole.esds > 0)
    assert np.allclose(whole.correlation, whole.correlation.T) and np.allclose(np.diag(whole.correlation), 1.0)
    assert np.all(np.abs(whole.correlation) <= 1.0 + 1e-12)
    d = whole.as_dict()
    assert d["cell_b"] == d["cell_a"]  # tetragonal: b is a
    assert d["N_a"] == pytest.approx(d["N"])  # isotropic, all N equal
    assert {"misset_x", "misset_y", "misset_z"} <= set(d)
    assert whole.condition >= 1.0


def test_esds_match_the_scatter_of_refits(problem_cache):
    """Calibration: refit the same truth with fresh noise; the spread matches the Fisher esd."""
    problem = problem_cache("cubic_mosflm", 32)
    sim, pmap, obj = _setup(problem, free=("scale", "background", "beam_centre"))
    esd = estimate_uncertainties(obj, pmap, pmap.raw0()).as_dict("fisher")["beam_x"]
    with torch.no_grad():
        mu = obj.full_model(pmap.expand({}))
    gen = torch.Generator().manual_seed(5)
    fits = []
    from refine.solver.loop import Convergence, minimise
    from refine.solver.strategies import LBFGS

    for _ in range(8):
        noisy = torch.poisson(mu, generator=gen)
        view = make_view(sim, problem.truth, torch.ones(sim.shape, dtype=torch.bool))
        o = ImageObjective(sim, noisy, view, poisson_deviance)
        res = minimise(lambda raw: (o(pmap.expand(pmap.physical(raw)))[0], None), pmap.raw0(), LBFGS(),
                       Convergence(max_steps=50, ftol=1e-8, xtol=1e-7))
        fits.append(pmap.physical_floats(res.state.raw)["beam_x"])
    spread = float(np.std(fits, ddof=1))
    assert 0.45 * esd < spread < 1.8 * esd, spread / esd  # 8 samples: the sample sd is within about +-50 %


@pytest.mark.parametrize("kind", ["diagonal", "full"])
def test_preconditioner_whitens_the_fisher_matrix(problem_cache, kind):
    problem = problem_cache("tetragonal_mosflm", 32)
    sim, pmap, obj = _setup(problem)
    raw0 = pmap.raw0()
    pre = make_preconditioner(kind, obj, pmap, raw0)
    assert torch.equal(pre.to_raw(pre.z0()), raw0)

    def model_fn(z, block):
        return obj.model(pmap.expand(pmap.physical(pre.to_raw(z))))

    Fz = fisher_information(model_fn, pre.z0(), [(0, 0)], lambda mu, b: 1.0 / mu)
    assert torch.allclose(torch.diagonal(Fz), torch.ones(len(raw0), dtype=F64), rtol=1e-6)
    if kind == "full":
        assert torch.allclose(Fz, torch.eye(len(raw0), dtype=F64), atol=1e-6)
    assert make_preconditioner(None, obj, pmap, raw0).A.equal(torch.eye(len(raw0), dtype=F64))


def test_cluster_scores_sum_squares_of_pixels():
    from refine.quality.uncertainty import cluster_scores

    J = torch.arange(2 * 5 * 3 * 2, dtype=torch.float64).reshape(2 * 5 * 3, 2)  # a 6 x 5 block, P = 2
    factor = torch.ones(30, dtype=torch.float64)
    S = cluster_scores(J, factor, (6, 5), 4)  # 2 x 2 squares of 4 (the last ones partial)
    img = J.reshape(6, 5, 2)
    assert S.shape == (4, 2)
    assert torch.allclose(S[0], img[:4, :4].sum(dim=(0, 1)))
    assert torch.allclose(S[1], img[:4, 4:].sum(dim=(0, 1)))
    assert torch.allclose(S[3], img[4:, 4:].sum(dim=(0, 1)))
    assert torch.allclose(cluster_scores(J, 2 * factor, (6, 5), 1), 2 * J)


def test_three_kinds_of_esds(problem_cache):
    """Right model, Poisson noise: sandwich ~ Fisher; scaled = Fisher x sqrt(excess); counts with more than Poisson
    scatter (each pixel's mean off by a random 50 %: a model that cannot explain the image) make the sandwich many
    times the Fisher esds, which assume the model is right."""
    problem = problem_cache("tetragonal_mosflm", 64)
    sim, pmap, obj = _setup(problem, free=("scale", "background", "beam_centre", "cell"))
    u = estimate_uncertainties(obj, pmap, pmap.raw0(), excess=4.0)
    fisher, scaled, sandwich = (u.as_dict(k) for k in ("fisher", "scaled", "sandwich"))
    assert u.kind == "sandwich" and u.as_dict() == sandwich
    for n in ("beam_x", "beam_y", "cell_a", "cell_c", "scale"):
        assert scaled[n] == pytest.approx(2.0 * fisher[n], rel=1e-12)
        assert 0.8 < sandwich[n] / fisher[n] < 1.25, (n, sandwich[n] / fisher[n])
    assert estimate_uncertainties(obj, pmap, pmap.raw0(), kind="fisher").as_dict() == fisher
    with torch.no_grad():
        mu = obj.full_model(pmap.expand({}))
    gen = torch.Generator().manual_seed(3)
    off = (1 + 0.5 * torch.randn(mu.shape, generator=gen, dtype=mu.dtype)).clamp(min=0.05)
    wrong = ImageObjective(sim, torch.poisson(mu * off, generator=gen), obj.view, poisson_deviance)
    bad = estimate_uncertainties(wrong, pmap, pmap.raw0()).as_dict()
    assert min(bad[n] / fisher[n] for n in ("beam_x", "beam_y", "cell_a", "cell_c", "scale")) > 5.0
