"""Tests for the losses package: values, masks/weights/reductions, errors, gradients."""

from __future__ import annotations

import math

import pytest
import torch

import losses
from losses import (
    GaussianNLL,
    Huber,
    LogIntensityMSE,
    NCCLoss,
    PoissonNLL,
    Restraint,
    Restraints,
    WeightedMSE,
    gaussian_nll,
    gaussian_restraint,
    get_loss,
    poisson_deviance,
    PoissonDeviance,
    huber,
    log_intensity_mse,
    normalized_cross_correlation,
    poisson_nll,
    weighted_mse,
)

F64 = torch.float64
LOSS_FUNCTIONS = [poisson_deviance, poisson_nll, gaussian_nll, weighted_mse, huber, log_intensity_mse, normalized_cross_correlation]


def t(values, dtype=F64, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=requires_grad)


def image_pair(seed: int = 0, shape=(4, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model = 0.5 + 5.0 * torch.rand(shape, generator=g, dtype=F64)
    observed = torch.poisson(model.detach(), generator=g)
    return model, observed


# ---------------------------------------------------------------- Poisson


def test_poisson_hand_values() -> None:
    model, observed = t([0.5, 2.0, 4.0]), t([1.0, 0.0, 3.0])
    per = [0.5 - math.log(0.5), 2.0, 4.0 - 3.0 * math.log(4.0)]
    assert torch.allclose(poisson_nll(model, observed, reduction="none"), t(per), rtol=1e-14)
    assert poisson_nll(model, observed, reduction="sum").item() == pytest.approx(sum(per), rel=1e-14)
    assert poisson_nll(model, observed).item() == pytest.approx(sum(per) / 3, rel=1e-14)
    full = poisson_nll(model, observed, reduction="sum", full=True).item()
    assert full == pytest.approx(sum(per) + math.log(6.0), rel=1e-14)  # lgamma(4) = log 3!


def test_poisson_integer_observed_is_cast() -> None:
    model = t([1.0, 2.0])
    a = poisson_nll(model, torch.tensor([1, 3]), reduction="sum")
    assert a.dtype == F64 and a.item() == pytest.approx(1.0 + 2.0 - 3.0 * math.log(2.0), rel=1e-14)


def test_poisson_zero_model_zero_observed_is_exact_zero_with_unit_gradient() -> None:
    model = t([0.0, 0.0, 1.5], requires_grad=True)
    observed = t([0.0, 0.0, 0.0])
    loss = poisson_nll(model, observed, reduction="sum")
    assert loss.item() == 1.5  # the log term contributes exactly 0 where observed == 0
    loss.backward()
    assert torch.equal(model.grad, t([1.0, 1.0, 1.0]))


def test_poisson_zero_model_positive_observed_finite_and_pushes_up() -> None:
    eps = 1e-12
    model = t([0.0], requires_grad=True)
    loss = poisson_nll(model, t([3.0]), reduction="sum")
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(-3.0 * (math.log(eps) - 1.0), rel=1e-12)  # tangent of log at eps
    loss.backward()
    assert torch.isfinite(model.grad).all()
    assert model.grad.item() == pytest.approx(1.0 - 3.0 / eps, rel=1e-12)
    # the continuation meets the exact loss at eps, so the loss is continuous there
    at_eps = poisson_nll(t([eps]), t([3.0]), reduction="sum").item()
    assert at_eps == pytest.approx(eps - 3.0 * math.log(eps), rel=1e-14)


def test_poisson_float32_zero_model_finite() -> None:
    model = torch.zeros(3, requires_grad=True)
    loss = poisson_nll(model, torch.tensor([0.0, 1.0, 5.0]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(model.grad).all()


def test_poisson_minimum_at_observed() -> None:
    observed = t([2.0, 7.0, 0.5])
    model = observed.clone().requires_grad_(True)
    best = poisson_nll(model, observed)
    best.backward()
    assert torch.allclose(model.grad, torch.zeros(3, dtype=F64), atol=1e-15)  # d/dm = 1 - o/m = 0
    for shift in (-0.1, 0.1):
        assert poisson_nll(observed + shift, observed) > best


# ---------------------------------------------------------------- Gaussian


def test_gaussian_hand_values_default_variance() -> None:
    model, observed = t([1.0, 4.0]), t([2.0, 1.0])
    per = [0.5 * (1.0 / 2.0 + math.log(2.0)), 0.5 * (9.0 / 5.0 + math.log(5.0))]  # var = model + 1
    got = gaussian_nll(model, observed, readout_sigma=1.0, reduction="none")
    assert torch.allclose(got, t(per), rtol=1e-14)
    full = gaussian_nll(model, observed, readout_sigma=1.0, reduction="sum", full=True).item()
    assert full == pytest.approx(sum(per) + math.log(2 * math.pi), rel=1e-14)


def test_gaussian_explicit_variance_and_gradient_through_default_variance() -> None:
    model, observed = t([3.0, 1.0]), t([1.0, 1.0])
    got = gaussian_nll(model, observed, variance=t([4.0, 0.5]), reduction="none")
    assert torch.allclose(got, t([0.5 * (1.0 + math.log(4.0)), 0.5 * math.log(0.5)]), rtol=1e-14)
    assert gaussian_nll(model, observed, variance=2.0, reduction="sum").item() == pytest.approx(
        0.5 * (2.0 + 2 * math.log(2.0)), rel=1e-14)
    m = t([3.0], requires_grad=True)
    gaussian_nll(m, t([1.0]), readout_sigma=2.0, reduction="sum").backward()
    v, r = 3.0 + 4.0, 2.0
    assert m.grad.item() == pytest.approx(r / v - 0.5 * r * r / v**2 + 0.5 / v, rel=1e-14)


def test_gaussian_zero_variance_is_clamped() -> None:
    model = t([0.0, 1.0], requires_grad=True)
    loss = gaussian_nll(model, t([0.0, 1.0]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(model.grad).all()
    with pytest.raises(ValueError, match="readout_sigma"):
        gaussian_nll(model, t([0.0, 1.0]), readout_sigma=-1.0)
    with pytest.raises(ValueError, match="variance"):
        gaussian_nll(model, t([0.0, 1.0]), variance=t([1.0, 1.0, 1.0]))


# ---------------------------------------------------------------- MSE, Huber, log


def test_weighted_mse_hand_values() -> None:
    model, observed = t([1.0, 2.0, 3.0]), t([0.0, 0.0, 0.0])
    w = t([1.0, 0.5, 0.0])
    assert weighted_mse(model, observed).item() == pytest.approx(14.0 / 3.0, rel=1e-14)
    assert weighted_mse(model, observed, weights=w, reduction="sum").item() == pytest.approx(3.0, rel=1e-14)
    assert weighted_mse(model, observed, weights=w).item() == pytest.approx(3.0 / 1.5, rel=1e-14)


def test_huber_hand_values_and_delta() -> None:
    model, observed = t([0.5, 3.0, -4.0]), t([0.0, 0.0, 0.0])
    got = huber(model, observed, delta=2.0, reduction="none")
    assert torch.allclose(got, t([0.125, 2.0 * (3.0 - 1.0), 2.0 * (4.0 - 1.0)]), rtol=1e-14)
    assert huber(model, observed, reduction="sum").item() == pytest.approx(0.125 + 2.5 + 3.5, rel=1e-14)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="delta"):
            huber(model, observed, delta=bad)


def test_log_intensity_mse_hand_values() -> None:
    model, observed = t([0.0, 3.0, 9.0]), t([0.0, 1.0, 99.0])
    per = [0.0, math.log(4.0 / 2.0) ** 2, math.log(10.0 / 100.0) ** 2]
    assert torch.allclose(log_intensity_mse(model, observed, reduction="none"), t(per), rtol=1e-14)
    per2 = [0.0, math.log(5.0 / 3.0) ** 2, math.log(11.0 / 101.0) ** 2]
    assert log_intensity_mse(model, observed, reduction="sum", offset=2.0).item() == pytest.approx(sum(per2), rel=1e-14)
    with pytest.raises(ValueError, match="offset"):
        log_intensity_mse(model, observed, offset=0.0)
    with pytest.raises(ValueError, match="observed"):
        log_intensity_mse(model, t([0.0, -1.0, 1.0]))


# ---------------------------------------------------------------- NCC


def test_ncc_perfect_scaled_match_is_zero_and_anticorrelated_is_two() -> None:
    model, _ = image_pair(1)
    assert normalized_cross_correlation(model, 3.0 * model + 7.0).item() == pytest.approx(0.0, abs=1e-12)
    assert normalized_cross_correlation(model, 10.0 - model).item() == pytest.approx(2.0, abs=1e-12)


def test_ncc_hand_value() -> None:
    m, o = t([1.0, 2.0, 3.0, 4.0]), t([1.0, 3.0, 2.0, 4.0])
    # deviations (-1.5,-.5,.5,1.5) and (-1.5,.5,-.5,1.5): cov 4/4, variances 5/4 each -> NCC = 0.8
    assert normalized_cross_correlation(m, o).item() == pytest.approx(0.2, rel=1e-13)
    # weight 0 on the last pixel equals masking it out: (1,2,3) vs (1,3,2) -> NCC 0.5
    mask = torch.tensor([True, True, True, False])
    assert normalized_cross_correlation(m, o, mask=mask).item() == pytest.approx(0.5, rel=1e-13)
    assert normalized_cross_correlation(m, o, weights=t([1.0, 1.0, 1.0, 0.0])).item() == pytest.approx(0.5, rel=1e-13)
    # duplicating pixel 0 equals weight 2 on it
    dup = normalized_cross_correlation(t([1.0, 1.0, 2.0, 3.0, 4.0]), t([1.0, 1.0, 3.0, 2.0, 4.0]))
    assert normalized_cross_correlation(m, o, weights=t([2.0, 1.0, 1.0, 1.0])).item() == pytest.approx(dup.item(), rel=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_ncc_constant_images_are_safe(dtype: torch.dtype) -> None:
    o = torch.tensor([1.0, 5.0, 2.0, 8.0], dtype=dtype)
    for model, observed in ((torch.full((4,), 3.0, dtype=dtype), o), (o.clone(), torch.full((4,), 1e3, dtype=dtype)),
                            (torch.full((4,), 0.1, dtype=dtype), torch.full((4,), 2.0, dtype=dtype)),
                            (torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype))):
        model.requires_grad_(True)
        loss = normalized_cross_correlation(model, observed)
        loss.backward()
        assert loss.item() == pytest.approx(1.0, abs=1e-3)
        assert torch.isfinite(model.grad).all()


def test_ncc_float32_large_offset_perfect_match() -> None:
    x = 1000.0 + torch.tensor([0.0, 1.0, 2.0, 3.0, 1.0])
    assert normalized_cross_correlation(x, x).item() == pytest.approx(0.0, abs=1e-4)


def test_ncc_per_slice_dims_and_reductions() -> None:
    a, _ = image_pair(2, (3, 4))
    obs = torch.stack([a, -a, 2 * a])  # perfect, anti, perfect
    model = torch.stack([a, a, a])
    per = normalized_cross_correlation(model, obs, dim=(1, 2), reduction="none")
    assert per.shape == (3,)
    assert torch.allclose(per, t([0.0, 2.0, 0.0]), atol=1e-12)
    assert normalized_cross_correlation(model, obs, dim=(-2, -1)).item() == pytest.approx(2.0 / 3.0, abs=1e-12)
    assert normalized_cross_correlation(model, obs, dim=(1, 2), reduction="sum").item() == pytest.approx(2.0, abs=1e-12)
    mask = torch.ones(3, 3, 4, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="mask"):
        normalized_cross_correlation(model, obs, mask=mask, dim=(1, 2))
    for bad in (3, (1, 1), ()):
        with pytest.raises(ValueError, match="dim"):
            normalized_cross_correlation(model, obs, dim=bad)


# ---------------------------------------------------------------- masks, weights, reductions (all losses)


@pytest.mark.parametrize("fn", LOSS_FUNCTIONS)
def test_masked_pixels_ignored_even_if_nan(fn) -> None:
    model, observed = image_pair(3)
    mask = torch.ones_like(model, dtype=torch.bool)
    mask[0, :2] = False
    mask[2, 3] = False
    dirty_obs = observed.clone()
    dirty_obs[~mask] = float("nan")
    dirty_model = model.clone()
    dirty_model[0, 0] = 0.0
    dirty_model[0, 1] = float("nan")  # whatever the model holds on masked pixels is ignored
    dirty_model.requires_grad_(True)
    got = fn(dirty_model, dirty_obs, mask=mask)
    got.backward()
    ref = fn(model[mask], observed[mask])
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.isfinite(dirty_model.grad).all()
    assert (dirty_model.grad[~mask] == 0).all() and (dirty_model.grad[mask] != 0).any()
    with pytest.raises(ValueError, match="observed: NaN"):
        fn(model, dirty_obs)


@pytest.mark.parametrize("fn", [poisson_nll, gaussian_nll, weighted_mse, huber, log_intensity_mse])
def test_reductions_and_weights_elementwise(fn) -> None:
    model, observed = image_pair(4)
    mask = torch.rand(model.shape, generator=torch.Generator().manual_seed(5)) > 0.3
    w_row = torch.linspace(0.5, 2.0, model.shape[1], dtype=F64)  # broadcasts over rows
    none = fn(model, observed, mask=mask, weights=w_row, reduction="none")
    plain = fn(model, observed, reduction="none")
    assert none.shape == model.shape
    assert torch.equal(none[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
    assert torch.allclose(none[mask], (plain * w_row)[mask], rtol=1e-14)
    total = fn(model, observed, mask=mask, weights=w_row, reduction="sum")
    assert total.item() == pytest.approx(none.sum().item(), rel=1e-14)
    mean = fn(model, observed, mask=mask, weights=w_row, reduction="mean")
    w_total = (w_row.expand(model.shape) * mask).sum().item()
    assert mean.item() == pytest.approx(total.item() / w_total, rel=1e-14)
    assert fn(model, observed, weights=2.0).item() == pytest.approx(fn(model, observed).item(), rel=1e-14)


@pytest.mark.parametrize("fn", LOSS_FUNCTIONS)
def test_input_errors(fn) -> None:
    model, observed = image_pair(6)
    with pytest.raises(ValueError, match="observed: shape"):
        fn(model, observed[:, :4])
    with pytest.raises(ValueError, match="mask: shape"):
        fn(model, observed, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask: expected a bool"):
        fn(model, observed, mask=torch.ones(4, 5))
    with pytest.raises(ValueError, match="mask: all pixels"):
        fn(model, observed, mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="observed: NaN"):
        fn(model, torch.where(observed > 2, float("inf"), observed))
    with pytest.raises(ValueError, match="weights: shape"):
        fn(model, observed, weights=torch.ones(4))
    with pytest.raises(ValueError, match="weights: must be"):
        fn(model, observed, weights=-torch.ones(5))
    with pytest.raises(ValueError, match="weights: .*zero"):
        fn(model, observed, weights=torch.zeros(5))
    with pytest.raises(ValueError, match="reduction"):
        fn(model, observed, reduction="average")
    with pytest.raises(ValueError, match="model: expected a floating"):
        fn(torch.ones(4, 5, dtype=torch.int64), observed)
    with pytest.raises(ValueError) as info:
        fn(model, observed[:3])
    assert "\n" not in str(info.value)  # one-line messages


# ---------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("fn", LOSS_FUNCTIONS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck(fn, reduction: str) -> None:
    model, observed = image_pair(7, (3, 4))
    model.requires_grad_(True)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1, 2] = False
    weights = (0.5 + torch.rand(3, 4, generator=torch.Generator().manual_seed(8), dtype=F64)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda m, w: fn(m, observed, mask=mask, weights=w, reduction=reduction),
                                    (model, weights))


def test_gradcheck_gaussian_explicit_variance_and_readout() -> None:
    model, observed = image_pair(9, (2, 3))
    model.requires_grad_(True)
    var = (1.0 + model.detach()).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda m, v: gaussian_nll(m, observed, variance=v), (model, var))
    assert torch.autograd.gradcheck(lambda m: gaussian_nll(m, observed, readout_sigma=1.5, full=True), (model,))


def test_gradcheck_poisson_below_eps_and_ncc_per_slice() -> None:
    m = t([0.0, 2e-13, 0.5, 3.0], requires_grad=True)  # two pixels on the tangent continuation
    assert torch.autograd.gradcheck(lambda x: poisson_nll(x, t([0.0, 2.0, 1.0, 4.0]), eps=1e-3), (m,))
    model, observed = image_pair(10, (2, 3, 4))
    model.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: normalized_cross_correlation(x, observed, dim=(1, 2), reduction="none"), (model,))


# ---------------------------------------------------------------- modules and registry


@pytest.mark.parametrize(
    "name, cls, kw, fn, fkw",
    [
        ("poisson", PoissonDeviance, {}, poisson_deviance, {}),
        ("poisson_nll", PoissonNLL, {"full": True}, poisson_nll, {"full": True}),
        ("gaussian", GaussianNLL, {"readout_sigma": 2.0}, gaussian_nll, {"readout_sigma": 2.0}),
        ("mse", WeightedMSE, {}, weighted_mse, {}),
        ("huber", Huber, {"delta": 0.5}, huber, {"delta": 0.5}),
        ("log", LogIntensityMSE, {"offset": 3.0}, log_intensity_mse, {"offset": 3.0}),
        ("ncc", NCCLoss, {"dim": 1, "reduction": "none"}, normalized_cross_correlation, {"dim": 1, "reduction": "none"}),
    ],
)
def test_modules_and_get_loss_match_functions(name, cls, kw, fn, fkw) -> None:
    model, observed = image_pair(11)
    mask = torch.ones_like(model, dtype=torch.bool)
    mask[1, 1] = False
    weights = torch.linspace(1.0, 2.0, 5, dtype=F64)
    module = get_loss(name, **kw)
    assert type(module) is cls and isinstance(module, torch.nn.Module)
    expected = fn(model, observed, mask=mask, weights=weights, **fkw)
    assert torch.equal(module(model, observed, mask=mask, weights=weights), expected)
    assert torch.equal(cls(**kw)(model, observed, mask, weights), expected)


def test_gaussian_module_variance_argument() -> None:
    model, observed = image_pair(12)
    var = 2.0 + model
    assert torch.equal(GaussianNLL()(model, observed, variance=var), gaussian_nll(model, observed, variance=var))


def test_get_loss_errors() -> None:
    with pytest.raises(ValueError, match="poisson, poisson_nll, gaussian, mse, huber, log, ncc"):
        get_loss("l1")
    with pytest.raises(ValueError, match="kw"):
        get_loss("mse", delta=1.0)
    with pytest.raises(ValueError, match="reduction"):
        get_loss("huber", reduction="max")


def test_package_exports() -> None:
    for name in losses.__all__:
        assert getattr(losses, name) is not None
    assert set(losses.LOSSES) == {"poisson", "poisson_nll", "gaussian", "mse", "huber", "log", "ncc"}


# ---------------------------------------------------------------- restraints


def test_gaussian_restraint_values_and_gradcheck() -> None:
    assert gaussian_restraint(t([1.0, 2.0]), 0.0, 2.0).item() == pytest.approx(0.5 * (0.25 + 1.0), rel=1e-15)
    assert gaussian_restraint(t(101.0), t(100.0), t(0.5)).item() == pytest.approx(2.0, rel=1e-15)
    got = gaussian_restraint(t([1.0, 3.0]), t([0.0, 1.0]), t([1.0, 4.0]))
    assert got.item() == pytest.approx(0.5 * (1.0 + 0.25), rel=1e-15)
    assert Restraint(100.0, 0.5)(t(99.0)).item() == pytest.approx(2.0, rel=1e-15)
    v = t([1.0, -2.0, 0.3], requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: gaussian_restraint(x, t([0.5, 0.0, 1.0]), t([1.0, 2.0, 0.1])), (v,))
    for bad in (0.0, -1.0, float("nan"), t([1.0, 0.0])):
        with pytest.raises(ValueError, match="sigma"):
            gaussian_restraint(t([1.0, 2.0]), 0.0, bad)
    with pytest.raises(ValueError, match="do not broadcast"):
        gaussian_restraint(t([1.0, 2.0]), t([1.0, 2.0, 3.0]), 1.0)


def test_restraints_total_terms_and_errors() -> None:
    r = Restraints({"cell_a": (100.0, 0.5), "misset_x": (0.0, 0.1)})
    params = {"cell_a": t(101.0), "misset_x": t(0.05), "distance": t(100.0)}  # distance is unrestrained
    terms = r.terms(params)
    assert set(terms) == {"cell_a", "misset_x"}
    assert terms["cell_a"].item() == pytest.approx(2.0, rel=1e-15)
    assert terms["misset_x"].item() == pytest.approx(0.125, rel=1e-14)
    assert r(params).item() == pytest.approx(2.125, rel=1e-14)
    with pytest.raises(ValueError, match="misset_x"):
        r({"cell_a": t(101.0), "misset_xx": t(0.0)})
    with pytest.raises(ValueError, match="sigma"):
        Restraints({"cell_a": (100.0, 0.0)})
    with pytest.raises(ValueError, match="target, sigma"):
        Restraints({"cell_a": 100.0})
    assert Restraints({})(params).item() == 0.0
    a = t(100.3, requires_grad=True)
    b = t(0.02, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: r({"cell_a": x, "misset_x": y}), (a, b))


# ---------------------------------------------------------------- one Poisson deviance, one meaning per name


def test_poisson_deviance_hand_values_and_nll_gradient() -> None:
    model, observed = t([2.0, 0.5, 4.0]), t([3.0, 0.0, 4.0])
    per = [2.0 - 3.0 + 3.0 * math.log(3.0 / 2.0), 0.5, 0.0]
    assert torch.allclose(poisson_deviance(model, observed, reduction="none"), t(per), rtol=1e-14)
    m = model.clone().requires_grad_(True)
    (g_dev,) = torch.autograd.grad(poisson_deviance(m, observed, reduction="sum"), m)
    (g_nll,) = torch.autograd.grad(poisson_nll(m, observed, reduction="sum"), m)
    assert torch.allclose(g_dev, g_nll, rtol=1e-14)  # a constant per pixel apart


def test_refinement_and_registry_share_the_poisson_deviance() -> None:
    """'poisson' means the half deviance in losses.get_loss and in the refinement, computed by one kernel."""
    from losses import kernels
    from refine.fitting.objective import poisson_deviance as refine_deviance
    from refine.fitting.objective import resolve_loss

    assert resolve_loss("poisson") is kernels.poisson_deviance is refine_deviance
    model, observed = image_pair(21)
    weights = torch.ones_like(model)
    weights[0, 0] = 0.0
    dense = get_loss("poisson", reduction="sum")(model, observed, mask=weights > 0)
    assert torch.allclose(resolve_loss("poisson")(model, observed, weights), dense, rtol=1e-13)


@pytest.mark.parametrize("name", ["poisson_nll", "gaussian", "mse", "huber", "log", "ncc"])
def test_refinement_losses_equal_the_registry_modules(name) -> None:
    """Every registry name means in the refinement (check-free kernels, summed over weighted pixels) what
    get_loss(name, reduction='sum') computes with its checks, ignored pixels holding anything finite."""
    from refine.fitting.objective import resolve_loss

    model, observed = image_pair(22)
    weights = torch.ones_like(model)
    weights[1, 2] = 0.0
    junk = observed.clone()
    junk[1, 2] = -1e6  # an ignored pixel with a value no loss accepts
    expected = get_loss(name, reduction="sum")(model, observed, mask=weights > 0)
    m = model.clone().requires_grad_(True)
    got = resolve_loss(name)(m, junk, weights)
    assert torch.allclose(got, expected, rtol=1e-12)
    (g,) = torch.autograd.grad(got, m)
    assert torch.isfinite(g).all() and g[1, 2] == 0


def test_kernels_compile_without_graph_breaks() -> None:
    from losses.kernels import poisson_deviance as kernel

    model, observed = image_pair(23)
    weights = torch.ones_like(model)
    compiled = torch.compile(kernel, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(model, observed, weights), kernel(model, observed, weights))
