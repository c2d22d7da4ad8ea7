"""The esds from first derivatives (forward mode, sparse pixels) equal those of the former path: dense image
blocks of 64 rows and a Jacobian by an eager double backward (reproduced here as the reference), to 1e-6
relative, for every kind, with and without priors, on the synthetic problems and on a sparse, restricted
(measured-like) case; with interpolated structure factors (autograd's forward mode through the hot loop) and
without (the analytic jvp of :class:`nbtorch.physics.square_sum.SquareOrientationSum`, as in the tutorial)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import nbtorch
from nbtorch import Simulator
from nbtorch.cli.args import config_from_args
import nbtorch.physics.square_sum as square_sum
import refine.quality.uncertainty as unc
from refine.fitting.objective import ImageObjective, make_view, poisson_deviance
from refine.fitting.parameters import ParameterMap, ParameterSpace

FREE = ("scale", "background", "orientation", "cell", "beam_centre", "mosaic")
PRIORS = {"cell_a": (0.0, 0.05), "beam_x": (0.0, 0.002), "mosaic_spread": (0.0, 0.01)}


def double_backward_jacobian(model_fn, theta):
    """The former ``_block_jacobian``: ``J[:, i] = d g_i / d u`` with ``g = J^T u = grad(u . mu)``."""
    with nbtorch.eager():
        th = theta.detach().clone().requires_grad_(True)
        mu = model_fn(th)
        u = torch.zeros_like(mu, requires_grad=True)
        (g,) = torch.autograd.grad((u * mu).sum(), th, create_graph=True)
        cols = []
        for i in range(theta.numel()):
            col = None
            if g[i].requires_grad:
                (col,) = torch.autograd.grad(g[i], u, retain_graph=True, allow_unused=True)
            cols.append(torch.zeros_like(mu) if col is None else col)
        return mu.detach(), torch.stack([c.reshape(-1) for c in cols], -1).detach()


def dense_loss(model, observed, weights):  # not ``pixelwise``: the objective evaluates whole images (old layout)
    return poisson_deviance(model, observed, weights)


def _case(problem, restricted: bool, priors: bool, analytic: bool = False):
    # analytic: no F interpolation, so the hot loop's forward mode is SquareOrientationSum's jvp
    sim = Simulator(config_from_args(list(problem.args) + (["-nointerpolate"] if analytic else [])),
                    dtype=torch.float64, compile=False)
    truth = problem.truth
    use = torch.ones(sim.shape, dtype=torch.bool)
    if restricted:  # a sparse pixel choice, the simulator computing only those pixels (as nbtorch-refine does)
        gen = np.random.default_rng(3)
        mask = gen.random(tuple(sim.shape)) < 0.3
        mask[: sim.shape[0] // 3, : sim.shape[1] // 2] = True
        sim = sim.restricted(mask)
        use = torch.as_tensor(mask)
    space = ParameterSpace(symmetry=problem.symmetry, pixel_mm=sim.setup.pixel_m * 1e3)
    names = space.expand(FREE)
    pmap = ParameterMap(space, truth, names)
    phys = pmap.physical_floats(pmap.raw0())
    prior = {n: (phys[n] + 0.3 * s, s) for n, (_, s) in PRIORS.items() if n in names} if priors else None
    obs = torch.as_tensor(problem.observed)
    view = make_view(sim, truth, use)
    new = ImageObjective(sim, obs, view, priors=prior)
    old = ImageObjective(sim, obs, view, dense_loss, priors=prior)
    return pmap, new, old


@pytest.mark.parametrize("name,restricted,priors,analytic", [
    ("cubic_mosflm", False, False, False), ("tetragonal_mosflm", False, True, False),
    ("tetragonal_mosflm", True, True, False), ("tetragonal_mosflm", True, True, True),
    ("cubic_mosflm", False, False, True)])
def test_first_derivative_esds_equal_the_double_backward_ones(problem_cache, monkeypatch, name, restricted, priors,
                                                              analytic):
    pmap, new_obj, old_obj = _case(problem_cache(name, 32), restricted, priors, analytic)
    assert new_obj.sparse and not old_obj.sparse
    reverse = unc.estimate_uncertainties(new_obj, pmap, pmap.raw0(), excess=3.0)  # small: reverse mode
    with monkeypatch.context() as m:  # the forward mode of larger blocks
        m.setattr(unc, "REVERSE_JACOBIAN_EVALUATIONS", 0)
        forward = unc.estimate_uncertainties(new_obj, pmap, pmap.raw0(), excess=3.0)
    with monkeypatch.context() as m:
        m.setattr(unc, "pixel_jacobian", double_backward_jacobian)
        m.setattr(unc, "REVERSE_JACOBIAN_EVALUATIONS", 0)
        old = unc.estimate_uncertainties(old_obj, pmap, pmap.raw0(), rows_per_block=64, excess=3.0)
    for new in (forward, reverse):
        assert_same_esds(new, old)
        assert new.condition == pytest.approx(old.condition, rel=1e-6)


@pytest.mark.parametrize("analytic", [False, True])
def test_jacobian_is_exact_and_blocks_do_not_matter(problem_cache, analytic):
    pmap, obj, _ = _case(problem_cache("tetragonal_mosflm", 32), True, False, analytic)
    theta = torch.stack(list(pmap.physical(pmap.raw0()).values())).detach()

    def model(th):
        return obj.pixel_model(pmap.expand({n: th[i] for i, n in enumerate(pmap.names)}))

    calls = []
    original = square_sum.square_sum_jvp
    square_sum.square_sum_jvp = lambda *a: calls.append(1) or original(*a)
    try:
        mu, J = unc.pixel_jacobian(model, theta)
    finally:
        square_sum.square_sum_jvp = original
    assert bool(calls) == analytic
    mu_ref, J_ref = double_backward_jacobian(model, theta)
    assert torch.allclose(mu, mu_ref, rtol=1e-13, atol=0)
    assert torch.allclose(J, J_ref, rtol=1e-12, atol=1e-12 * float(J_ref.abs().max()))
    whole = unc.estimate_uncertainties(obj, pmap, pmap.raw0(), rows_per_block=1000)
    rows = unc.estimate_uncertainties(obj, pmap, pmap.raw0(), rows_per_block=8)
    assert np.allclose(whole.fisher, rows.fisher, rtol=1e-10)
    for kind in unc.ESD_KINDS:
        assert all(whole.as_dict(kind)[n] == pytest.approx(v, rel=1e-8) for n, v in rows.as_dict(kind).items())


@pytest.mark.parametrize("analytic", [False, True])
def test_reverse_jacobian_equals_the_forward_one(problem_cache, analytic):
    """:func:`refine.quality.uncertainty.reverse_pixel_jacobian` (small blocks) gives the forward-mode J and mu (1e-12),
    a parameter the model does not depend on a zero column, no parameter an empty J."""
    pmap, obj, _ = _case(problem_cache("tetragonal_mosflm", 32), True, False, analytic)
    theta = torch.stack(list(pmap.physical(pmap.raw0()).values())).detach()

    def model(th):
        return obj.pixel_model(pmap.expand({n: th[i] for i, n in enumerate(pmap.names)}))

    mu, J = unc.pixel_jacobian(model, theta)
    mu_r, J_r = unc.reverse_pixel_jacobian(model, theta)
    assert J.shape == J_r.shape and float(J.abs().max()) > 0
    assert torch.allclose(mu_r, mu, rtol=1e-13, atol=0)
    assert torch.allclose(J_r, J, rtol=1e-12, atol=1e-12 * float(J.abs().max()))
    extra = torch.cat([theta, theta.new_ones(1)])  # a parameter the model ignores
    _, J_x = unc.reverse_pixel_jacobian(lambda th: model(th[:-1]), extra)
    assert torch.equal(J_x[:, -1], torch.zeros_like(J_x[:, -1])) and torch.allclose(J_x[:, :-1], J_r)
    _, J_0 = unc.reverse_pixel_jacobian(lambda th: model(theta), theta.new_zeros(0))
    assert J_0.shape == (mu.numel(), 0)


def test_a_small_run_with_esds_never_imports_dynamo(tmp_path):
    """The esds of a small problem (reverse mode) do not import ``torch._dynamo``, which torch's eager forward
    mode does (~1 s of the README's main job), nor does anything else of a small eager run."""
    code = ("import sys\nfrom refine.cli.main import main\n"
            "code = main(['--problem', 'tetragonal_mosflm', '--size', '32', '--refine', 'scale,background,cell,"
            "orientation', '--max-steps', '5', '--no-compile', '--quiet', '--out', sys.argv[1], '--json', "
            "sys.argv[2]])\nprint('exit', code, 'dynamo', 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r.h5"), str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "NBTORCH_CACHE_DIR": str(tmp_path / "cache")})
    assert "exit 0 dynamo False" in done.stdout, done.stdout + done.stderr[-2000:]
    esds = json.loads((tmp_path / "r.json").read_text())["esds"]
    assert {"cell_a", "cell_c", "scale", "orient_x"} <= set(esds) and all(0 < v < 1e3 for v in esds.values()), esds


def assert_same_esds(new, old) -> None:
    """The same Fisher matrix (1e-9), esds of every kind (1e-6) and correlations (1e-6) of two estimates."""
    assert np.abs(old.fisher).max() > 0
    assert np.allclose(new.fisher, old.fisher, rtol=1e-9, atol=0)
    for kind in unc.ESD_KINDS:
        a, b = new.as_dict(kind), old.as_dict(kind)
        assert a.keys() == b.keys()
        for n in a:
            assert a[n] == pytest.approx(b[n], rel=1e-6), (kind, n)
    assert np.allclose(new.correlation, old.correlation, rtol=1e-6, atol=1e-9)
