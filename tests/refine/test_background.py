"""The background models of refine.fitting.background: parsing, the spline and plane functions, the knots'
gradients against finite differences on a simulated image with spots, the held planes' fit, and a refinement."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

from nbtorch.errors import InputError
from refine.fitting.background import (
    DEFAULT_KNOTS, BackgroundSpec, fit_window_planes, is_knot, linear_spline, parse_background, plane_background,
    plane_photons,
)
from refine.fitting.objective import ImageObjective, make_view, poisson_deviance
from refine.fitting.parameters import ParameterMap, ParameterSpace
from refine.inputs.selection import resolution_map
from refine.solver.plan import background_model
from refine.solver.runner import refine

F64 = torch.float64


@pytest.mark.parametrize("text, spec", [("constant", BackgroundSpec("constant")), ("planar", BackgroundSpec("planar")),
                                        ("resolution", BackgroundSpec("resolution", DEFAULT_KNOTS)),
                                        ("resolution:3", BackgroundSpec("resolution", 3)),
                                        ("planes", BackgroundSpec("planes"))])
def test_parse_background(text, spec):
    assert parse_background(text) == spec
    assert parse_background(spec.text) == spec


@pytest.mark.parametrize("text, message", [
    ("resolution:-2", "the knot count must be 2 to 16"), ("resolution:1", "the knot count must be 2 to 16"),
    ("resolution:x", "needs an integer knot count"), ("wavy", "unknown kind 'wavy'"), ("planes:3", "takes no ':3'"),
])
def test_bad_background_is_one_line(text, message):
    with pytest.raises(InputError, match=message):
        parse_background(text)


def test_knot_names_and_space():
    space = ParameterSpace(symmetry="tetragonal", background="resolution:3")
    assert space.group("background") == ("background_0", "background_1", "background_2")
    assert space.expand(["scale", "background"]) == ("scale", "background_0", "background_1", "background_2")
    assert ParameterSpace(background="planes").group("background") == ("background",)
    assert is_knot("background_12") and not is_knot("background_x") and not is_knot("background")
    with pytest.raises(InputError, match="unknown kind"):
        ParameterSpace(background="cubic")


def test_linear_spline_values_and_gradient():
    knots = torch.tensor([2.0, 5.0, 3.0], dtype=F64)
    u = torch.tensor([-1.0, 0.0, 0.5, 1.0, 1.25, 2.0, 7.0], dtype=F64)
    expected = torch.tensor([2.0, 2.0, 3.5, 5.0, 4.5, 3.0, 3.0], dtype=F64)
    assert torch.allclose(linear_spline(knots, u), expected, rtol=0, atol=1e-14)
    u_in = torch.linspace(0.05, 1.95, 9, dtype=F64)
    assert gradcheck(lambda k: linear_spline(k, u_in), (knots.clone().requires_grad_(),), eps=1e-6, atol=1e-9)
    # teeth: a wrong derivative fails the same check
    wrong = lambda k: linear_spline(k.detach(), u_in) + 1.01 * (k - k.detach()).sum()  # noqa: E731
    with pytest.raises(Exception):
        gradcheck(wrong, (knots.clone().requires_grad_(),), eps=1e-6, atol=1e-9)


def test_plane_photons_gradient():
    coefficients = torch.tensor([[5.0, 0.2, -0.1], [8.0, -0.3, 0.4]], dtype=F64, requires_grad=True)
    window = torch.tensor([0, 0, 1, 1, 1])
    dx = torch.tensor([-2.0, 1.0, 0.0, 3.0, -1.0], dtype=F64)
    dy = torch.tensor([1.0, 2.0, -3.0, 1.0, 0.0], dtype=F64)
    out = plane_photons(coefficients, window, dx, dy)
    assert float(out[3].detach()) == pytest.approx(8.0 - 0.9 + 0.4)
    assert gradcheck(lambda c: plane_photons(c, window, dx, dy), (coefficients,), eps=1e-6, atol=1e-9)


def _tetragonal_start(problem_cache, background: float):
    """The 32-pixel tetragonal problem: simulator, observed photons, all-valid mask and starting values (scale 1.1,
    a flat ``background``)."""
    problem = problem_cache("tetragonal_mosflm", 32)
    sim = problem.simulator()
    obs = torch.as_tensor(problem.observed, dtype=F64)
    valid = torch.ones(sim.shape, dtype=torch.bool)
    values = {n: float(v) for n, v in sim.setup.params.items()}
    values.update(orient_x=0.0, orient_y=0.0, orient_z=0.0, scale=1.1, background=background, background_x=0.0,
                  background_y=0.0)
    return sim, obs, valid, values


def _objective_and_values(problem_cache, sparse: bool):
    sim, obs, valid, values = _tetragonal_start(problem_cache, 3.0)
    model = background_model(sim, "resolution:4", values, obs, valid)
    values.update(model.start)
    view = make_view(sim, values, valid)
    loss = poisson_deviance if sparse else (lambda m, o, w: poisson_deviance(m, o, w))
    return ImageObjective(sim, obs, view, loss, background_model=model), values, model


@pytest.mark.parametrize("sparse", [True, False])
def test_knot_gradients_match_finite_differences(problem_cache, sparse):
    """d loss / d background_k by autograd against central differences, on a simulated image with spots."""
    objective, values, model = _objective_and_values(problem_cache, sparse)
    assert objective.sparse == sparse
    assert float(objective.sim.render()[0].max()) > 0  # a non-zero image
    space = ParameterSpace(symmetry="tetragonal", background="resolution:4")
    names = ("scale",) + model.names
    values = {**values, **{n: values[n] * (1.0 + 0.1 * k) for k, n in enumerate(model.names)}}  # off the optimum
    pmap = ParameterMap(space, values, names)
    raw = pmap.raw0().clone().requires_grad_()
    loss, _ = objective.evaluate(pmap.expand(pmap.physical(raw)))
    (grad,) = torch.autograd.grad(loss, raw)
    for i, name in enumerate(names):
        h = 1e-5
        step = torch.zeros_like(raw)
        step[i] = h
        with torch.no_grad():
            up = float(objective.evaluate(pmap.expand(pmap.physical(raw + step)))[0])
            down = float(objective.evaluate(pmap.expand(pmap.physical(raw - step)))[0])
        fd = (up - down) / (2 * h)
        assert abs(float(grad[i])) > 1e-3, name  # nothing passes as 0 = 0
        assert float(grad[i]) == pytest.approx(fd, rel=1e-6, abs=1e-8), name


def test_sparse_and_dense_background_agree(problem_cache):
    sparse, values, _ = _objective_and_values(problem_cache, True)
    dense, _, _ = _objective_and_values(problem_cache, False)
    loss_s, aux = sparse.evaluate(values)
    loss_d, image = dense.evaluate(values)
    assert float(loss_s) == pytest.approx(float(loss_d), rel=1e-12)
    assert torch.allclose(sparse.model_image(aux), image, rtol=1e-12, atol=0)


def _plane_image(shape=(64, 64), seed=3):
    """Poisson counts of a tilted background with three Gaussian spots, and the spots' positions."""
    ny, nx = shape
    yy, xx = np.mgrid[0:ny, 0:nx]
    truth = 20.0 + 0.15 * (xx - 32) - 0.1 * (yy - 32)
    spots = np.array([[15.5, 20.5], [40.5, 44.5], [48.5, 12.5]])
    image = truth.copy()
    for x, y in spots:
        image += 400.0 * np.exp(-((xx + 0.5 - x) ** 2 + (yy + 0.5 - y) ** 2) / (2 * 1.0 ** 2))
    return np.random.default_rng(seed).poisson(image).astype(float), truth, spots


def test_window_planes_recover_a_tilted_background():
    image, truth, spots = _plane_image()
    coefficients, window, has = fit_window_planes(image, np.ones(image.shape, bool), spots, half_px=7)
    assert has.all()
    for w, (x, y) in enumerate(spots):
        i, j = int(math.floor(x)), int(math.floor(y))
        assert coefficients[w, 0] == pytest.approx(truth[j, i], abs=1.5)  # ~ 0.6 photons of Poisson noise
        assert coefficients[w, 1] == pytest.approx(0.15, abs=0.15)
        assert window[j, i] == w
    assert window[0, 63] == -1
    model = plane_background(image, np.ones(image.shape, bool), spots, 7, (0, 63, 0, 63))
    held = model.held.numpy()
    inside = ~np.isnan(held)
    assert inside.sum() == 3 * 15 * 15 and model.windows == 3
    assert np.abs(held[inside] - truth[inside]).mean() < 1.5
    # outside the windows the flat background applies
    out = model.photons({"background": 7.0}, (0, 63, 0, 63), None, F64, torch.device("cpu"))
    assert float(out[0, 63]) == 7.0 and float(out[20, 15]) == pytest.approx(held[20, 15])


@pytest.mark.parametrize("spots, half, message", [
    (None, 3, "needs observed spots"), (np.array([[5.5, 5.5]]), None, "needs --spot-window"),
    (np.array([[5.5, 5.5]]), 40, r"a window of 81 px is larger than the image \(64 x 64 px\)"),
])
def test_bad_plane_settings(spots, half, message):
    image, _, _ = _plane_image()
    with pytest.raises(InputError, match=message):
        plane_background(image, np.ones(image.shape, bool), spots, half, (0, 63, 0, 63))


def test_refine_with_a_resolution_background_recovers_a_radial_one(problem_cache):
    """A background rising with resolution under a simulated image at the true geometry: the spline fits it, the
    flat one cannot."""
    problem = problem_cache("tetragonal_mosflm", 32)
    sim = problem.simulator()
    truth = {n: v for n, v in problem.truth.items() if n not in ("scale", "background", "background_x", "background_y")}
    s = 1.0 / resolution_map(sim, None, truth)
    radial = 10.0 + 30.0 * (s - s.min()) / (s.max() - s.min())
    with torch.no_grad():
        bragg = sim.render(**{n: torch.tensor(float(truth[n]), dtype=F64) for n in sim.setup.params if n in truth})[0]
    observed = np.random.default_rng(5).poisson(bragg.numpy() + radial).astype(float)
    runs = {bg: refine(problem, observed, start=truth, free=("scale", "background"), background=bg, progress=False,
                       esds=False) for bg in ("constant", "resolution:4")}
    knots = [runs["resolution:4"].params[f"background_{k}"] for k in range(4)]
    assert knots[-1] - knots[0] > 20.0  # the rise is found
    assert knots[0] == pytest.approx(10.0, abs=3.0) and knots[-1] == pytest.approx(40.0, abs=3.0)
    assert "background" not in runs["resolution:4"].params
    assert runs["resolution:4"].loss_final < runs["constant"].loss_final - 50.0
    assert runs["resolution:4"].fit["excess"] < 1.5
    assert runs["resolution:4"].background_image is not None


def test_planes_objective_gradient_of_the_flat_background_outside_the_windows(problem_cache):
    """With held planes the flat ``background`` acts only outside the windows: its derivative (and the scale's)
    against central differences, and the held pixels do not depend on it."""
    sim, obs, valid, values = _tetragonal_start(problem_cache, 30.0)
    spots = np.array([[8.5, 8.5], [20.5, 12.5]])
    model = background_model(sim, "planes", values, obs, valid, spots=spots, half_px=3)
    assert model.windows == 2
    objective = ImageObjective(sim, obs, make_view(sim, values, valid), poisson_deviance, background_model=model)
    space = ParameterSpace(symmetry="tetragonal", background="planes")
    pmap = ParameterMap(space, values, ("scale", "background"))
    raw = pmap.raw0().clone().requires_grad_()
    loss, aux = objective.evaluate(pmap.expand(pmap.physical(raw)))
    (grad,) = torch.autograd.grad(loss, raw)
    for i in range(2):
        step = torch.zeros_like(raw)
        step[i] = 1e-5
        with torch.no_grad():
            fd = (float(objective.evaluate(pmap.expand(pmap.physical(raw + step)))[0])
                  - float(objective.evaluate(pmap.expand(pmap.physical(raw - step)))[0])) / 2e-5
        assert abs(float(grad[i])) > 1e-3
        assert float(grad[i]) == pytest.approx(fd, rel=1e-6, abs=1e-8)
    image = objective.model_image(aux.detach())
    held = ~torch.isnan(model.held)
    other = objective.model_image(objective.evaluate({**values, "background": 50.0})[1].detach())
    assert torch.equal(image[held], other[held]) and bool((other[~held] > image[~held]).all())


def test_the_background_table_is_made_once_per_request_on_a_gpu(monkeypatch):
    """On a GPU an evaluation's table is made once (a host-to-device copy, which a CUDA graph's capture may not
    contain) and the same tensor returned after, never dropped; other positions get their own; on a CPU it is made
    at each call (no second copy per still held)."""
    from refine.fitting import background
    from refine.fitting.background import BackgroundModel, BackgroundSpec

    held = torch.arange(12, dtype=F64).reshape(3, 4)
    model = BackgroundModel(spec=BackgroundSpec("planes"), roi=(0, 3, 0, 2), held=held, start={}, windows=1)
    used, cpu = torch.tensor([0, 5, 11]), torch.device("cpu")
    first = model._table((0, 3, 0, 2), used, F64, cpu)
    assert first.tolist() == [0.0, 5.0, 11.0] and model._table((0, 3, 0, 2), used, F64, cpu) is not first  # a CPU
    monkeypatch.setattr(background, "_keeps_tables", lambda device: True)  # as on a GPU
    first = model._table((0, 3, 0, 2), used, F64, cpu)
    assert model._table((0, 3, 0, 2), used, F64, cpu) is first
    other = torch.tensor([1, 2])
    second = model._table((0, 3, 0, 2), other, F64, cpu)
    assert second.tolist() == [1.0, 2.0] and model._table((0, 3, 0, 2), other, F64, cpu) is second
    assert model._table((0, 3, 0, 2), used, F64, cpu) is first  # both kept: a later stage's does not drop it
