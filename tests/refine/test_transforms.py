"""Tests for refine.fitting.transforms: values, round trips, domains, gradients, default_transform."""

from __future__ import annotations

import math

import pytest
import torch

import refine
from nbtorch.parameters import PARAMETER_NAMES
from refine import TRANSFORM_NAMES, Bounded, Identity, LogPositive, Multiplicative, Positive, default_transform

F64 = torch.float64


def t(values, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=requires_grad)


TRANSFORMS = [
    (Identity(0.1, 50.0), t([-1e3, -3.0, 0.0, 49.9, 50.0, 1e4])),
    (Positive(2.0), t([1e-9, 1e-3, 0.7, 2.0, 50.0, 3e3, 1e8])),
    (LogPositive(1e29), t([1e20, 1e29, 3e31, 1e35])),
    (Bounded(-1.0, 1.0), t([-0.999999, -0.5, 0.0, 0.3, 0.999999])),
    (Bounded(5.0, 7.5), t([5.000001, 6.0, 7.49])),
]


def test_hand_values() -> None:
    assert Identity(0.1, 5.0)(t(2.0)).item() == pytest.approx(5.2, rel=1e-15)
    assert Identity(0.1, 5.0).inverse(t(4.0)).item() == pytest.approx(-10.0, rel=1e-14)
    assert Positive(2.0)(t(0.0)).item() == pytest.approx(2.0 * math.log(2.0), rel=1e-15)
    assert Positive(2.0).inverse(t(2.0)).item() == pytest.approx(math.log(math.e - 1.0), rel=1e-15)
    assert LogPositive(3.0)(t(1.0)).item() == pytest.approx(3.0 * math.e, rel=1e-15)
    assert LogPositive(3.0).inverse(t(3.0)).item() == 0.0
    assert Bounded(0.0, 10.0)(t(0.0)).item() == 5.0
    assert Bounded(0.0, 10.0)(t(math.log(3.0))).item() == pytest.approx(7.5, rel=1e-15)
    assert Bounded(0.0, 10.0).inverse(t(2.5)).item() == pytest.approx(-math.log(3.0), rel=1e-15)
    assert Bounded(2.0, 6.0).scale == 4.0 and Positive(3.0).scale == 3.0 and Identity(0.1).scale == 0.1


@pytest.mark.parametrize("transform, values", TRANSFORMS)
def test_round_trip_float64(transform, values) -> None:
    raw = transform.inverse(values)
    assert torch.isfinite(raw).all()
    back = transform(raw)
    assert torch.allclose(back, values, rtol=1e-12, atol=0.0)
    raws = t([-8.0, -1.0, 0.0, 0.5, 3.0, 8.0])
    assert torch.allclose(transform.inverse(transform(raws)), raws, rtol=0.0, atol=1e-9)


def test_positive_is_exact_for_large_and_tiny_values() -> None:
    p = Positive(1.0)
    # torch's softplus returns x above 20; the exact value differs by log1p(exp(-x))
    assert (p(t(25.0)) - 25.0).item() == pytest.approx(math.log1p(math.exp(-25.0)), rel=1e-6)
    assert p.inverse(t(1e6)).item() == 1e6  # log(expm1(1e6)) would overflow
    assert p(t(1e4)).item() == 1e4 and p(t(-1e4)).item() == 0.0
    assert p.inverse(t(1e-300)).item() == pytest.approx(math.log(1e-300), rel=1e-15)
    raw = t([-1e4, -30.0, 0.0, 30.0, 1e4], requires_grad=True)
    p(raw).sum().backward()
    expected = torch.sigmoid(raw.detach())
    assert torch.allclose(raw.grad, expected, rtol=1e-15)  # d softplus = sigmoid, 0.5 at 0
    assert raw.grad[2].item() == 0.5


@pytest.mark.parametrize("transform, values", TRANSFORMS)
def test_gradcheck_forward_and_inverse(transform, values) -> None:
    raw = transform.inverse(values).clamp(-20.0, 20.0).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(transform, (raw,))
    interior = transform(t([-2.0, 0.0, 1.5])).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(transform.inverse, (interior,))


def test_float32_and_shapes() -> None:
    raw = torch.zeros(2, 3)
    for tr in (Identity(0.5), Positive(1.0), LogPositive(2.0), Bounded(0.0, 1.0)):
        out = tr(raw)
        assert out.shape == (2, 3) and out.dtype == torch.float32
        assert torch.allclose(tr.inverse(out), raw, atol=1e-6)
    with pytest.raises(ValueError, match="raw: expected a floating"):
        Positive(1.0)(torch.zeros(2, dtype=torch.int64))


def test_inverse_outside_domain_raises() -> None:
    with pytest.raises(ValueError, match="value: Positive"):
        Positive(1.0).inverse(t([1.0, 0.0]))
    with pytest.raises(ValueError, match="value: LogPositive"):
        LogPositive(1.0).inverse(t(-1.0))
    for v in (-1.0, 1.0, 2.0):
        with pytest.raises(ValueError, match="value: Bounded"):
            Bounded(-1.0, 1.0).inverse(t(v))


def test_constructor_errors() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            Positive(bad)
        with pytest.raises(ValueError, match="scale"):
            LogPositive(bad)
        with pytest.raises(ValueError, match="scale"):
            Identity(bad)
    with pytest.raises(ValueError, match="offset"):
        Identity(1.0, float("nan"))
    with pytest.raises(ValueError, match="high"):
        Bounded(1.0, 1.0)
    with pytest.raises(ValueError, match="low"):
        Bounded(float("-inf"), 1.0)


# ---------------------------------------------------------------- default_transform

TYPICAL = {
    "cell_a": 78.0, "cell_b": 80.0, "cell_c": 90.0, "cell_alpha": 75.0, "cell_beta": 85.0, "cell_gamma": 95.0,
    "misset_x": 10.0, "misset_y": -20.0, "misset_z": 0.0, "phi0": 0.0, "mosaic_spread": 0.2,
    "mosaic_spread_a": 0.1, "mosaic_spread_b": 0.2, "mosaic_spread_c": 0.4,
    "N_a": 5.0, "N_b": 5.0, "N_c": 10.0, "N_d": 1.0, "N_e": -0.5, "N_f": 0.0, "distance": 100.0, "beam_x": 51.25, "beam_y": 48.0,
    "detector_rotx": 0.0, "detector_roty": 0.1, "detector_rotz": -0.1, "twotheta": 0.0,
    "wavelength": 1.0, "fluence": 1.26e29, "polarization": 0.0, "default_F": 100.0,
    "dispersion": 0.2, "divergence_h": 0.1, "divergence_v": 0.05,
}


def test_default_transform_covers_every_canonical_parameter() -> None:
    assert set(TRANSFORM_NAMES) == set(PARAMETER_NAMES) == set(TYPICAL)


@pytest.mark.parametrize("name", sorted(TYPICAL))
def test_default_transform_round_trip_and_step_size(name: str) -> None:
    value = TYPICAL[name]
    tr = default_transform(name, value)
    raw = tr.inverse(t(value)).requires_grad_(True)
    out = tr(raw)
    assert out.item() == pytest.approx(value, rel=1e-12, abs=1e-12)
    out.backward()
    # a raw step of 1 moves the value by 0.25..1 times the transform's scale
    assert 0.25 * tr.scale <= raw.grad.item() <= 1.0 * tr.scale * (1 + 1e-12)


def test_default_transform_choices() -> None:
    for name in ("cell_a", "N_b", "distance", "wavelength"):
        tr = default_transform(name, TYPICAL[name])
        assert type(tr) is Positive and tr.scale == TYPICAL[name]
    assert type(default_transform("fluence", 1e24)) is LogPositive
    assert default_transform("fluence", 1e24).scale == 1e24
    assert default_transform("mosaic_spread", 0.01).scale == 0.05
    assert default_transform("mosaic_spread", 0.5).scale == 0.5
    assert type(default_transform("mosaic_spread", 0.5)) is Positive
    identity_scales = {
        "cell_alpha": 0.05, "cell_beta": 0.05, "cell_gamma": 0.05,
        "misset_x": 0.02, "misset_y": 0.02, "misset_z": 0.02, "phi0": 0.02,
        "detector_rotx": 0.05, "detector_roty": 0.05, "detector_rotz": 0.05, "twotheta": 0.05,
        "beam_x": 0.1, "beam_y": 0.1,
    }
    for name, scale in identity_scales.items():
        tr = default_transform(name, 12.0)
        assert type(tr) is Identity and tr.scale == scale and tr.offset == 12.0
        assert tr.inverse(t(12.0)).item() == 0.0  # raw starts at 0
    pol = default_transform("polarization", 0.9)
    assert type(pol) is Bounded and (pol.low, pol.high) == (-1.0, 1.0)
    f = default_transform("default_F", 0.0)
    assert type(f) is Identity and f.scale == 1.0
    assert default_transform("default_F", -300.0).scale == 300.0
    assert default_transform("cell_b", torch.tensor([80.0])).scale == 80.0


def test_default_transform_errors() -> None:
    with pytest.raises(ValueError, match="name: unknown parameter 'cell_d'.*cell_a"):
        default_transform("cell_d", 1.0)
    with pytest.raises(ValueError, match="F_grid"):
        default_transform("F_grid", 1.0)
    for name in ("cell_a", "N_a", "distance", "wavelength", "fluence", "mosaic_spread"):
        with pytest.raises(ValueError, match=name):
            default_transform(name, 0.0)
    with pytest.raises(ValueError, match="polarization"):
        default_transform("polarization", 1.0)
    with pytest.raises(ValueError, match="value"):
        default_transform("beam_x", float("nan"))
    with pytest.raises(ValueError, match="single number"):
        default_transform("cell_a", torch.ones(2))


def test_package_exports() -> None:
    transforms = {"Transform", "Identity", "Positive", "LogPositive", "Bounded", "Multiplicative",
                  "default_transform", "TRANSFORM_NAMES"}
    assert transforms <= set(refine.__all__)
    assert {"refine", "RefinementResult", "Stage", "stage_a", "LBFGS", "Adam", "Status", "make_problem",
            "TensorBoardCallback", "estimate_uncertainties"} <= set(refine.__all__)
    for name in refine.__all__:
        assert getattr(refine, name) is not None
    assert all(issubclass(c, refine.Transform) for c in (Identity, Positive, LogPositive, Bounded, Multiplicative))


def test_multiplicative() -> None:
    tr = Multiplicative(50.0, 0.01)
    assert tr.scale == pytest.approx(0.5)
    assert tr(t(0.0)).item() == 50.0
    assert tr(t(1.0)).item() == pytest.approx(50.0 * math.exp(0.01), rel=1e-15)
    values = t([1e-3, 49.0, 50.0, 1e4])
    assert torch.allclose(tr(tr.inverse(values)), values, rtol=1e-12)
    raw = t([-2.0, 0.5], requires_grad=True)
    assert torch.autograd.gradcheck(tr, (raw,))
    with pytest.raises(ValueError, match="value: Multiplicative"):
        tr.inverse(t(0.0))
    with pytest.raises(ValueError, match="step"):
        Multiplicative(1.0, 0.0)


def test_multiplicative_with_a_limit_saturates_and_never_overflows() -> None:
    """A structure factor's transform: near the start as the plain one, within e^limit of it for any raw value, so a
    line search's longest trial gives a finite value (the real sweep's NaN trials were exp overflowing to Inf)."""
    limit = math.log(1e4)
    tr, plain = Multiplicative(50.0, 0.01, limit), Multiplicative(50.0, 0.01)
    raw = torch.tensor([-1e6, -300.0, -10.0, 0.0, 10.0, 300.0, 1e6], dtype=torch.float64)
    v = tr(raw)
    assert torch.isfinite(v).all() and bool((v > 50.0 / 1e4 * 0.999).all()) and bool((v < 50.0 * 1e4 * 1.001).all())
    assert torch.isinf(plain(torch.tensor([1e6], dtype=torch.float64))).all()  # the unlimited one overflows
    near = torch.tensor([-50.0, 5.0, 50.0], dtype=torch.float64)  # within 1.7x of the start
    assert tr(near).numpy() == pytest.approx(plain(near).numpy(), rel=2e-3)
    values = torch.tensor([1e-2, 1.0, 50.0, 4e5], dtype=torch.float64)
    assert tr(tr.inverse(values)).numpy() == pytest.approx(values.numpy(), rel=1e-10)
    assert torch.autograd.gradcheck(tr, (torch.tensor([-200.0, 3.0, 400.0], dtype=torch.float64, requires_grad=True),))
    with pytest.raises(ValueError, match="within e\\^"):
        tr.inverse(torch.tensor([50.0 * 2e4], dtype=torch.float64))
