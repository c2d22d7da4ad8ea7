"""torch.autograd.gradcheck / gradgradcheck in float64 on ROIs of real images.

The function under check maps the (rescaled) parameters to three normalised
weighted sums of a 24 px ROI (``GradientProbe.gradcheck_inputs``), so the
full Jacobian costs three backward passes.  Checked: every parameter alone (in
spec and C-parity mode), all cell parameters jointly, all detector-geometry
parameters jointly, everything jointly, the structure-factor table, and the
cell parameters' second derivatives (``gradgradcheck``: LBFGS and Gauss-Newton
lean on curvature).  A control shows the tolerances have teeth: a gradient off by
1e-4 relative fails.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.autograd.gradcheck import GradcheckError

from gradient_probes import get_probe, one_thread_eager  # noqa: F401  (autouse fixture)
from nbtorch import PARAMETER_NAMES
from nbtorch.tools.gradcheck_report import CASES, CELL_PARAMS, GEOMETRY_PARAMS, ORIENTATION_DELTAS, PROBED_NAMES

RTOL = 1e-5
ATOL = 1e-9  # Jacobian entries are d(normalised sum)/d(unit): 1e-5 .. 5


def _gradcheck(probe, names, fast_mode=False):
    fn, inputs, eps = probe.gradcheck_inputs(names)
    out = fn(*inputs)
    assert torch.isfinite(out).all() and torch.allclose(out, torch.ones_like(out))
    jac = torch.autograd.functional.jacobian(fn, inputs)
    col = torch.stack([j.reshape(-1) for j in jac], -1)  # (outputs, inputs)
    assert torch.isfinite(col).all()
    assert (col.abs().amax(0) > 0).all(), f"zero derivative among {names}"
    return gradcheck(fn, inputs, eps=eps, atol=ATOL, rtol=RTOL, fast_mode=fast_mode)


@pytest.mark.parametrize("name", PROBED_NAMES)
@pytest.mark.parametrize("case", ["mosaic", "c_parity"])
def test_gradcheck_one_parameter(case, name):
    probe = get_probe(case)
    if name not in probe.names:
        pytest.skip(f"{case} has no spread along {name} (tests/gradients/test_parameter_gradients.py checks that)")
    if name in CASES[case].zero:  # a name the case's model does not use: exactly 0 (test_parameter_gradients)
        assert probe.autograd([name, "distance"])[name] == 0.0 and probe.finite_difference(name).value == 0.0
        return
    assert _gradcheck(probe, [name])


def test_gradcheck_size_matrix():
    """The six sizes of the anisotropic Gaussian crystal jointly (prefactor det N and exponent |N dh|^2)."""
    assert _gradcheck(get_probe("gauss_aniso"), ["N_a", "N_b", "N_c", "N_d", "N_e", "N_f"])


@pytest.mark.parametrize("group", ["cell", "geometry"])
@pytest.mark.parametrize("case", ["mosaic", "c_parity", "xds_sample", "c_parity_sensor", "sources_curved"])
def test_gradcheck_joint(case, group):
    names = [n for n in {"cell": CELL_PARAMS, "geometry": GEOMETRY_PARAMS}[group] if n not in CASES[case].zero]
    assert _gradcheck(get_probe(case), names)


@pytest.mark.parametrize("case", ["mosaic", "c_parity", "anisotropic_mosaic"])
def test_gradcheck_everything_at_once(case):
    """All canonical parameters the case uses and the orientation deltas jointly (fast mode: a random
    direction in parameter space, so the numerical side costs two evaluations)."""
    probe = get_probe(case)
    names = [n for n in list(PARAMETER_NAMES) + list(ORIENTATION_DELTAS) if n in probe.names and n not in CASES[case].zero]
    assert _gradcheck(probe, names, fast_mode=True)


@pytest.mark.parametrize("name", ["mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c"])
def test_gradcheck_anisotropic_mosaic(name):
    """Each spread of the anisotropic mosaic against finite differences, then the three jointly."""
    assert _gradcheck(get_probe("anisotropic_mosaic"), [name])


def test_gradcheck_anisotropic_mosaic_jointly_with_the_cell():
    """The domains depend on the cell through the crystal frame: the spreads and the cell together."""
    names = ["mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c", "cell_a", "cell_gamma", "misset_y"]
    assert _gradcheck(get_probe("anisotropic_mosaic"), names)


@pytest.mark.parametrize("case", ["mosaic", "c_parity"])
def test_gradgradcheck_cell(case):
    fn, inputs, eps = get_probe(case).gradcheck_inputs(list(CELL_PARAMS))
    assert gradgradcheck(fn, inputs, eps=eps, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("case", ["hkl_nearest", "hkl_tricubic"])
def test_gradcheck_structure_factor_table(case):
    """The table entries the ROI touches (at most 8, largest derivative first) in full mode,
    then the whole table in fast mode."""
    probe = get_probe(case)
    base = probe.sim.F_grid.detach().clone()
    g = probe.F_grid_gradient()
    n = min(8, int((g != 0).sum()))
    assert n >= 3
    idx = torch.topk(g.abs().reshape(-1), n).indices
    w = probe.weights

    def fn_entries(values):
        grid = base.reshape(-1).index_put((idx,), values).reshape(base.shape)
        return (w * probe.render(F_grid=grid)).sum((1, 2)) / probe.norms

    x = base.reshape(-1)[idx].clone().requires_grad_(True)
    assert gradcheck(fn_entries, (x,), eps=1e-3, atol=ATOL, rtol=RTOL)

    def fn_table(grid):
        return (w * probe.render(F_grid=grid)).sum((1, 2)) / probe.norms

    assert gradcheck(fn_table, (base.clone().requires_grad_(True),), eps=1e-3, atol=ATOL, rtol=RTOL, fast_mode=True)


def test_gradcheck_has_teeth():
    """Control: the same check rejects a gradient that is wrong by 1e-4 relative."""
    probe = get_probe("mosaic")
    fn, inputs, eps = probe.gradcheck_inputs(["cell_a"])

    def skewed(x):
        y = fn(x)
        # value unchanged, derivative scaled by (1 + 1e-4)
        return y + 1e-4 * (y - y.detach())

    with pytest.raises(GradcheckError):
        gradcheck(skewed, inputs, eps=eps, atol=ATOL, rtol=RTOL)
