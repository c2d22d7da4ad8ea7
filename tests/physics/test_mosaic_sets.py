"""The even, deterministic mosaic domain sets (nbtorch.physics.mosaic.even_mosaic_domains, -mosaic_model): their
symmetry and moments, the meaning of the spread, convergence in the count against the C's random draw, the choice of
model in spec mode and C parity, the gradients in the spread, and the one-line refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

from nbtorch import Simulator, config_from_args
from nbtorch.sampling.crng import mosaic_axis_angle_draws
from nbtorch.errors import InputError
from nbtorch.physics.mosaic import even_mosaic_domains, mosaic_set_turn, rocking_sigma_per_spread
from nbtorch.rules.resolve import EVEN_MOSAIC_DOMAINS

DT = torch.float64
BASE = ("-cell 70 80 90 75 85 95 -misset 10 20 30 -N 8 -lambda 1.0 -default_F 100 -distance 100 -detpixels 40 "
        "-pixel 0.5 -oversample 1")


def _vectors(count: int, model: str) -> torch.Tensor:
    axes, fractions = even_mosaic_domains(count, model)
    assert torch.allclose(axes.norm(dim=-1), torch.ones(count, dtype=DT), atol=1e-14)
    return axes * fractions[:, None]


@pytest.mark.parametrize("count", [2, 3, 4, 7, 10, 21, 64])
def test_even_sets_are_symmetric_pairs_and_deterministic(count):
    omega = _vectors(count, "gaussian")
    pairs = count // 2
    assert torch.allclose(omega[:pairs], -omega[pairs:2 * pairs], rtol=0, atol=1e-15)  # +omega, -omega
    if count % 2:
        assert torch.equal(omega[-1], torch.zeros(3, dtype=DT))  # odd: the unrotated crystal as well
    assert float(omega.mean(0).abs().max()) < 1e-15  # the mean orientation is the crystal's own
    assert torch.equal(omega, _vectors(count, "gaussian"))  # no random numbers: the same bits every time


@pytest.mark.parametrize("model, per_axis", [("gaussian", 1.0), ("ball", None)])
@pytest.mark.parametrize("count", [6, 10, 31, 200])
def test_second_moment_is_the_models_at_every_count(model, per_axis, count):
    """The set's rotation vectors have the model's covariance exactly: every reflection's mosaic rocking sigma is
    rocking_sigma_per_spread(model) spreads whatever the count (3 pairs or more)."""
    omega = _vectors(count, model)
    sigma = rocking_sigma_per_spread(model)
    assert per_axis is None or sigma == per_axis
    assert torch.allclose(omega.T @ omega / count, sigma ** 2 * torch.eye(3, dtype=DT), rtol=0, atol=1e-13)


@pytest.mark.parametrize("turn", [1, 2, 7, 23])
def test_a_turned_set_keeps_its_pairs_and_moment_and_only_turns(turn):
    """-mosaic_turn K: the set's rotation vectors turned by one fixed rotation; still +omega/-omega pairs with the
    model's covariance, the angles unchanged, the axes moved; turn 0 is the set as built."""
    R = mosaic_set_turn(turn)
    assert torch.allclose(R @ R.T, torch.eye(3, dtype=DT), atol=1e-14) and float(torch.linalg.det(R)) == pytest.approx(1)
    omega = _vectors(40, "ball")
    turned = omega @ R.T
    assert torch.allclose(turned[:20], -turned[20:], rtol=0, atol=1e-15)
    sigma = rocking_sigma_per_spread("ball")
    assert torch.allclose(turned.T @ turned / 40, sigma ** 2 * torch.eye(3, dtype=DT), rtol=0, atol=1e-13)
    assert float((turned - omega).abs().max()) > 0.1
    assert torch.equal(mosaic_set_turn(0), torch.eye(3, dtype=DT))
    sampling = Simulator(config_from_args(f"{BASE} -mosaic 0.3 -mosaic_dom 40 -mosaic_turn {turn}".split()),
                         compile=False).setup.sampling
    axes, fractions = even_mosaic_domains(40, "ball")
    assert np.allclose(sampling.mosaic_axes, (axes @ R.T).numpy(), atol=1e-15)
    assert np.array_equal(sampling.mosaic_fractions, fractions.numpy())


def test_a_turned_set_gives_another_sampling_of_the_same_image():
    """A sharp crystal at 20 domains: the turned set's image differs from the set's (where the domains lie: 0.08 of
    the image), and both are about as far from the 640-domain image (0.09, 0.08)."""
    sharp = "-mosaic 0.6 -N 15"
    limit = _image(f"{sharp} -mosaic_dom 640")
    plain, turned = _image(f"{sharp} -mosaic_dom 20"), _image(f"{sharp} -mosaic_dom 20 -mosaic_turn 3")
    apart = float((plain - turned).norm() / limit.norm())
    errs = [float((img - limit).norm() / limit.norm()) for img in (plain, turned)]
    assert apart > 0.04 and max(errs) < 1.5 * min(errs), (apart, errs)


def test_ball_rocking_sigma_is_the_c_draws():
    """The C's law (angle spread (1 - r^2)^(1/3) about a random axis): rms of one component 0.4964 spreads."""
    axes, fracs = mosaic_axis_angle_draws(40000, 7)
    component = axes[:, 0] * fracs
    assert math.sqrt(float(np.mean(component ** 2))) == pytest.approx(rocking_sigma_per_spread("ball"), rel=0.01)
    assert rocking_sigma_per_spread("random") == rocking_sigma_per_spread("ball") == pytest.approx(0.4964, abs=1e-4)


def test_gaussian_angles_follow_the_maxwell_law():
    """Large sets: the angles' quantiles are those of |z| for a standard normal 3-vector (before the exact-moment
    map, which changes them by little at this count)."""
    _, fractions = even_mosaic_domains(2000, "gaussian")
    q = np.quantile(fractions.numpy(), [0.1, 0.5, 0.9])
    assert q == pytest.approx([0.7644, 1.5382, 2.5003], rel=0.01)  # Maxwell (chi, 3 dof) quantiles


def _image(flags: str) -> torch.Tensor:
    return Simulator(config_from_args(f"{BASE} {flags}".split()), compile=False)()


def test_even_set_converges_in_the_count_faster_than_the_random_draw():
    """The same crystal with 10 and 40 domains against 640 of the same model: the even sets are nearer their limits
    than the C's random draw is to its own at each count (the image's relative L2 difference), the even set of the
    C's law (the default) by more than a factor 2."""
    def err(model_flags: str, count: int, limit: torch.Tensor) -> float:
        img = _image(f"{model_flags} -mosaic_dom {count}")
        return float((img - limit).norm() / limit.norm())

    ball_limit = _image("-mosaic 0.6 -mosaic_dom 640")
    random_limit = _image("-mosaic 0.6 -mosaic_model random -mosaic_dom 640")
    gauss = "-mosaic 0.3 -mosaic_model gaussian"
    gauss_limit = _image(f"{gauss} -mosaic_dom 640")
    for count in (10, 40):
        even = err("-mosaic 0.6", count, ball_limit)
        drawn = err("-mosaic 0.6 -mosaic_model random", count, random_limit)
        assert even < 0.5 * drawn and err(gauss, count, gauss_limit) < drawn, (count, even, drawn)
    assert err("-mosaic 0.6", 40, ball_limit) < 0.5 * err("-mosaic 0.6", 10, ball_limit)


def test_even_ball_set_is_the_c_law():
    """The even set of the C's law and the C's random draw tend to the same image."""
    even = _image("-mosaic 0.6 -mosaic_model ball -mosaic_dom 200")
    drawn = _image("-mosaic 0.6 -mosaic_model random -mosaic_dom 1000")
    assert float((even - drawn).norm() / drawn.norm()) < 0.03


@pytest.mark.parametrize("flags, model, count", [
    ("-mosaic 0.3", "ball", EVEN_MOSAIC_DOMAINS), ("-mosaic 0.3 -mosaic_dom 7", "ball", 7),
    ("-mosaic 0.3 -mosaic_model gaussian", "gaussian", EVEN_MOSAIC_DOMAINS), ("-mosaic 0.3 -mosaic_seed 5", "random", 10),
    ("-mosaic 0.3 -c_parity", "random", 10), ("-mosaic 0.3 -c_parity -mosaic_model ball", "ball", EVEN_MOSAIC_DOMAINS),
    ("-mosaic 0.3 -mosaic_dom 1", "ball", 1), ("-mosaic 0", "ball", 1), ("", "ball", 1)])
def test_the_model_and_count_each_config_gets(flags, model, count):
    s = Simulator(config_from_args(f"{BASE} {flags}".split()), compile=False).setup.sampling
    assert (s.mosaic_model, len(s.mosaic_fractions)) == (model, count)


@pytest.mark.parametrize("flags, message", [
    ("-mosaic 0.3 -mosaic_model sphere", "-mosaic_model: unknown model 'sphere'"),
    ("-mosaic 0.3 -mosaic_model gaussian -mosaic_seed 3", "-mosaic_seed: the gaussian mosaic set is even"),
    ("-mosaic 0.3 -mosaic_dom 200000", "-mosaic_dom: the ball mosaic set is built with 1 to 100000 domains"),
    ("-mosaic 0.3 -mosaic_model gaussian -mosaic_dom 0", "-mosaic_dom: the gaussian mosaic set is built with 1 to"),
    ("-mosaic 0.3 -mosaic_dom -4", "-mosaic_dom: must not be negative")])
def test_bad_mosaic_settings_are_one_line(flags, message):
    with pytest.raises(InputError) as err:
        Simulator(config_from_args(f"{BASE} {flags}".split()), compile=False)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_with_mosaic_domains_halves_average_to_the_doubled_set():
    sim = Simulator(config_from_args(f"{BASE} -mosaic 0.3 -mosaic_dom 8".split()), compile=False)
    doubled = sim.with_mosaic_domains(16)()
    halves = [sim.with_mosaic_domains(16, part, 2) for part in (0, 1)]
    assert all(len(h.setup.sampling.mosaic_fractions) == 8 for h in halves)
    assert torch.allclose((halves[0]() + halves[1]()) / 2, doubled, rtol=1e-12, atol=0)
    assert torch.equal(doubled, _image("-mosaic 0.3 -mosaic_dom 16"))
    assert len(sim.setup.sampling.mosaic_fractions) == 8  # unchanged


@pytest.mark.parametrize("flags, names", [
    ("-mosaic 0.3 -mosaic_dom 6", ("mosaic_spread",)),
    ("-mosaic 0.3 -mosaic_abc 0.2 0.3 0.45 -mosaic_dom 7", ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c"))])
def test_gradient_in_the_spread_matches_finite_differences(flags, names):
    """gradcheck (eager, float64) of a few spot pixels in the spread(s) of the even Gaussian set."""
    sim = Simulator(config_from_args(f"{BASE} {flags} -roi 12 27 12 27".split()), dtype=DT, compile=False)
    img = sim().detach()
    assert float(img.max()) > 0
    weights = torch.rand(img.shape, generator=torch.Generator().manual_seed(1), dtype=DT) / float(img.max())

    def loss(*values):
        return (sim(**dict(zip(names, values))) * weights).sum()

    start = tuple(getattr(sim, n).detach().clone().requires_grad_(True) for n in names)
    grads = torch.autograd.grad(loss(*start), start)
    assert all(abs(float(g)) > 1e-3 for g in grads)
    assert gradcheck(loss, start, eps=1e-6, atol=1e-7, rtol=1e-4)
