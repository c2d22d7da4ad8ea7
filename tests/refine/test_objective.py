"""The sparse objective path: Simulator.render_pixels and ImageObjective on the fitted pixels only.

A fit on a sparse pixel mask (spot windows plus a few per cent of the rest, as the
real-data tutorial) must give the loss, gradients and model image of the dense path
(every image of the view's rectangle), whatever the simulator itself computes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch.errors import InputError
from refine.fitting.objective import ImageObjective, make_view, poisson_deviance, resolve_loss

F64 = torch.float64
GRAD = ("cell_a", "beam_x", "mosaic_spread", "orient_y", "scale", "background", "background_x")


def _dense(loss):
    """The same loss without the ``pixelwise`` mark: ImageObjective then takes the dense path."""
    return lambda model, observed, weights: loss(model, observed, weights)


def _values(problem, sim):
    vals = {n: torch.tensor(float(v), dtype=F64) for n, v in sim.setup.params.items()}
    vals.update({n: torch.tensor(0.0, dtype=F64) for n in ("orient_x", "orient_y", "orient_z")})
    vals.update(scale=torch.tensor(1.3, dtype=F64), background=torch.tensor(2.0, dtype=F64),
                background_x=torch.tensor(0.01, dtype=F64), background_y=torch.tensor(-0.02, dtype=F64))
    vals["beam_x"] = vals["beam_x"] + 0.05  # off the truth: nonzero gradients
    return {k: v.clone().requires_grad_(k in GRAD) for k, v in vals.items()}


def _loss_and_grads(objective, vals, dense_call=False):
    loss, model = objective(vals) if dense_call else objective.evaluate(vals)
    grads = torch.autograd.grad(loss, [vals[n] for n in GRAD])
    return loss.detach(), objective.model_image(model.detach()) if not dense_call else model.detach(), grads


def _mask(shape, fraction, seed):
    return np.random.default_rng(seed).random(shape) < fraction


def test_render_pixels_is_render_without_the_zeros(problem_cache):
    sim = problem_cache("tetragonal_mosflm", 32).simulator()
    image, stats = sim.render()
    values, index, stats_px = sim.render_pixels()
    assert torch.equal(index, torch.arange(image.numel()))  # no mask: every pixel, in order
    assert torch.equal(values, image.reshape(-1))
    mask = _mask(sim.shape, 0.3, 1)
    sim = sim.restricted(mask)
    image, stats = sim.render()
    values, index, stats_px = sim.render_pixels()
    assert torch.equal(index, torch.as_tensor(np.flatnonzero(mask)))  # the new mask, not the cached indices
    assert torch.equal(values, image.reshape(-1)[index])
    assert float(image.reshape(-1)[~torch.as_tensor(mask.reshape(-1))].abs().max()) == 0.0
    assert float(values.min()) > 0.0  # a test that can fail: the simulated pixels are not zero
    for key, value in (("image_max", image.max()), ("image_mean", image.mean()), ("image_sum", image.sum())):
        assert float(stats[key]) == pytest.approx(float(value), rel=1e-12)  # those of the image, zeros included
        assert float(stats_px[key]) == pytest.approx(float(value), rel=1e-12)
    roi = (4, 20, 3, 11)  # a sub-rectangle: positions are flat in the ROI
    image, _ = sim.render(roi=roi)
    values, index, _ = sim.render_pixels(roi=roi)
    assert torch.equal(values, image.reshape(-1)[index])
    assert torch.equal(index, torch.as_tensor(np.flatnonzero(mask[3:12, 4:21])))


@pytest.mark.parametrize("sim_mask", ["same", "superset", "none", "subset"])
def test_sparse_objective_matches_the_dense_one(problem_cache, sim_mask):
    """Loss, gradients and model image agree whatever the simulator computes around the fitted pixels."""
    problem = problem_cache("tetragonal_mosflm", 32)
    sim = problem.simulator()
    obs = torch.as_tensor(problem.observed)
    use = _mask(sim.shape, 0.25, 2)
    if sim_mask == "same":
        sim = sim.restricted(use)
    elif sim_mask == "superset":
        sim = sim.restricted(use | _mask(sim.shape, 0.3, 3))
    elif sim_mask == "subset":  # pixels the simulator skips are 0 in both paths
        sim = sim.restricted(use & _mask(sim.shape, 0.7, 4))
    vals = _values(problem, sim)
    view = make_view(sim, {k: float(v.detach()) for k, v in vals.items()}, torch.as_tensor(use), fraction=0.8)
    sparse = ImageObjective(sim, obs, view, poisson_deviance)
    dense = ImageObjective(sim, obs, view, _dense(poisson_deviance))
    assert sparse.sparse and not dense.sparse
    loss_s, model_s, grads_s = _loss_and_grads(sparse, vals)
    loss_d, model_d, grads_d = _loss_and_grads(dense, vals)
    assert float(loss_s) == pytest.approx(float(loss_d), rel=1e-12)
    assert torch.allclose(model_s, model_d, rtol=1e-13, atol=0)
    for name, gs, gd in zip(GRAD, grads_s, grads_d):
        assert float(gd) != 0.0, name
        assert float(gs) == pytest.approx(float(gd), rel=1e-9), name
    # __call__ keeps its meaning: (loss, binned model image), differentiable
    loss_c, model_c, _ = _loss_and_grads(sparse, vals, dense_call=True)
    assert float(loss_c) == float(loss_s) and torch.equal(model_c, model_s)
    assert torch.allclose(model_s, sparse.model(vals).detach(), rtol=1e-13, atol=0)


def test_registry_losses_are_sparse_and_agree(problem_cache):
    problem = problem_cache("tetragonal_mosflm", 32)
    sim = problem.simulator()
    obs = torch.as_tensor(problem.observed)
    use = _mask(sim.shape, 0.4, 5)
    sim = sim.restricted(use)
    vals = _values(problem, sim)
    view = make_view(sim, {k: float(v.detach()) for k, v in vals.items()}, torch.as_tensor(use))
    for name in ("gaussian", "ncc"):
        loss = resolve_loss(name)
        sparse, dense = ImageObjective(sim, obs, view, loss), ImageObjective(sim, obs, view, _dense(loss))
        assert sparse.sparse and not dense.sparse
        loss_s, _, grads_s = _loss_and_grads(sparse, vals)
        loss_d, _, grads_d = _loss_and_grads(dense, vals)
        assert float(loss_s) == pytest.approx(float(loss_d), rel=1e-10), name
        for g_name, gs, gd in zip(GRAD, grads_s, grads_d):
            assert float(gs) == pytest.approx(float(gd), rel=1e-8, abs=1e-12), (name, g_name)


def test_binned_views_and_unmarked_losses_stay_dense(problem_cache):
    problem = problem_cache("tetragonal_mosflm", 32)
    sim = problem.simulator()
    obs = torch.as_tensor(problem.observed)
    values = {k: float(v) for k, v in problem.truth.items()}
    everything = torch.ones(sim.shape, dtype=torch.bool)
    assert not ImageObjective(sim, obs, make_view(sim, values, everything, bin=2)).sparse
    assert not ImageObjective(sim, obs, make_view(sim, values, everything), _dense(poisson_deviance)).sparse
    assert ImageObjective(sim, obs, make_view(sim, values, everything)).sparse


# ------------------------------------------------------------------------------------------ priors

def test_priors_add_the_restraint_to_the_loss_and_the_fisher_information(problem_cache):
    """A Gaussian prior adds 0.5 ((value - mean) / sigma)^2 to the loss (gradient checked by finite differences) and
    1 / sigma^2 to the Fisher information; bad priors are one-line errors naming the input."""
    from refine.fitting.objective import check_priors
    from refine.fitting.parameters import ParameterMap, ParameterSpace
    from refine.quality.uncertainty import estimate_uncertainties

    problem = problem_cache("cubic_mosflm", 32)
    sim = problem.simulator()
    obs = torch.as_tensor(problem.observed)
    view = make_view(sim, problem.truth, torch.ones(sim.shape, dtype=torch.bool))
    plain = ImageObjective(sim, obs, view)
    prior = ImageObjective(sim, obs, view, priors={"cell_a": (47.9, 0.05), "beam_x": (3.2, 0.01)})
    values = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in problem.truth.items()}
    expected = 0.5 * ((values["cell_a"] - 47.9) / 0.05) ** 2 + 0.5 * ((values["beam_x"] - 3.2) / 0.01) ** 2
    with torch.no_grad():
        assert float(prior.evaluate(values)[0] - plain.evaluate(values)[0]) == pytest.approx(float(expected), rel=1e-9)
    x = values["cell_a"].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(prior.prior_term({**values, "cell_a": x}), x)
    h = 1e-6
    with torch.no_grad():
        fd = (prior.prior_term({**values, "cell_a": x + h}) - prior.prior_term({**values, "cell_a": x - h})) / (2 * h)
    assert float(g) == pytest.approx(float(fd), rel=1e-6) and float(g) != 0.0
    space = ParameterSpace(symmetry="cubic", pixel_mm=0.1)
    pmap = ParameterMap(space, problem.truth, space.expand(("scale", "background", "cell", "beam_centre")))
    f0 = estimate_uncertainties(plain, pmap, pmap.raw0(), kind="fisher")
    f1 = estimate_uncertainties(prior, pmap, pmap.raw0(), kind="fisher")
    i = list(pmap.names).index("cell_a")
    assert f1.fisher[i, i] == pytest.approx(f0.fisher[i, i] + 1 / 0.05 ** 2, rel=1e-9)
    assert f1.as_dict()["cell_a"] < f0.as_dict()["cell_a"]
    for bad, message in ((({"cell_q": (1.0, 1.0)}), "priors: unknown parameter 'cell_q'"),
                         ({"cell_a": (48.0, 0.0)}, "priors cell_a: sigma must be finite and > 0"),
                         ({"cell_a": (float("nan"), 1.0)}, "priors cell_a: the mean must be finite"),
                         ({"cell_a": 48.0}, "priors cell_a: expected (mean, sigma)")):
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_priors(bad)
