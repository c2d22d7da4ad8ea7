"""The fit-against-noise report: the expectation of the Poisson deviance, and the warning on a false minimum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refine import refine
from refine.quality.fit_quality import EXCESS_WARNING, assess_poisson_fit, expected_poisson_deviance
from refine.fitting.objective import poisson_deviance
from refine.solver.stages import Stage


@pytest.mark.parametrize("m", [0.05, 0.7, 3.0, 12.0, 29.5, 30.0, 80.0, 1000.0])
def test_expectation_matches_monte_carlo(m):
    rng = np.random.default_rng(5)
    k = rng.poisson(m, 400_000).astype(np.float64)
    d = m - k + np.where(k > 0, k * np.log(np.maximum(k, 1.0) / m), 0.0)
    want, err = d.mean(), d.std() / np.sqrt(k.size)
    got = float(expected_poisson_deviance(torch.tensor([m], dtype=torch.float64))[0])
    assert abs(got - want) < 4 * err + 1e-4, (m, got, want, err)


def test_expectation_is_continuous_and_zero_for_empty_pixels():
    m = torch.tensor([0.0, -1.0, 30.0 - 1e-9, 30.0], dtype=torch.float64)
    e = expected_poisson_deviance(m)
    assert e[0] == 0 and e[1] == 0
    assert abs(float(e[2] - e[3])) < 2e-4  # the series and the sum meet
    big = expected_poisson_deviance(torch.full((3, 70_000), 4.0, dtype=torch.float64))  # chunked path
    assert big.shape == (3, 70_000) and torch.allclose(big, big[0, 0].expand_as(big))


def test_poisson_noise_on_the_model_gives_excess_near_one_and_a_shifted_model_does_not():
    rng = np.random.default_rng(1)
    y, x = np.mgrid[:96, :96]
    spots = sum(2000.0 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / 2.0) for cx in range(8, 96, 12) for cy in range(8, 96, 12))
    model = torch.as_tensor(spots + 20.0)
    obs = torch.as_tensor(rng.poisson(model.numpy()).astype(np.float64))
    w = torch.ones_like(model)
    q = assess_poisson_fit(float(poisson_deviance(model, obs, w)), model, w)
    assert 0.95 < q.excess < 1.05 and q.warning is None and q.pixels == 96 * 96
    shifted = torch.roll(model, 3, dims=1)  # spots predicted beside the observed ones
    q = assess_poisson_fit(float(poisson_deviance(shifted, obs, w)), shifted, w)
    assert q.excess > EXCESS_WARNING and "false minimum" in q.warning
    w[:, :48] = 0  # masked pixels do not count
    assert assess_poisson_fit(1.0, model, w).pixels == 96 * 48


def test_refinement_reports_the_fit_and_warns_on_a_false_minimum(problem_cache):
    problem = problem_cache("cubic_mosflm", 64)
    # only scale and background: the 0.3 deg orientation and 2 px beam errors stay, the optimiser converges anyway
    stuck = refine(problem, stages=(Stage("scale", ("scale", "background")),), progress=False, esds=False)
    assert stuck.status.ok
    assert stuck.fit["excess"] > EXCESS_WARNING
    assert len(stuck.warnings) == 2 and "shot noise" in stuck.warnings[0]
    # the scale shrank towards 0 to fit spots predicted beside the observed ones: no pixel carries the model's signal
    assert stuck.fit["signal_spots"] == 0 and stuck.warnings[1] == stuck.fit["support_warning"]
    assert stuck.warnings[1].startswith("no fitted pixel carries the model's signal")
    assert stuck.to_json_dict()["warnings"] == list(stuck.warnings)
    assert "warning:" in stuck.summary()
    # at the truth the same report is quiet
    at_truth = refine(problem, start=problem.truth, stages=(Stage("scale", ("scale", "background")),),
                      progress=False, esds=False)
    assert at_truth.fit["excess"] < 1.5 and at_truth.warnings == ()


def _spot_image(centres, shape=(64, 64), height=400.0, background=20.0):
    y, x = np.mgrid[:shape[0], :shape[1]]
    bragg = sum(height * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / 2.0) for cx, cy in centres)
    return bragg + background


def test_signal_support_counts_pixels_and_spots_and_warns_below_five_spots_per_parameter(caplog):
    from refine.quality.fit_quality import MIN_SPOTS_PER_PARAMETER, signal_support

    centres = [(cx, cy) for cx in range(6, 64, 16) for cy in range(6, 64, 20)]  # 4 x 3 = 12 spots
    centres.append((centres[0][0] + 3, centres[0][1]))  # touching the first one: still its own spot
    model = _spot_image(centres)
    mask = np.ones(model.shape, dtype=bool)
    s = signal_support(model, 20.0, mask, 2)
    assert s.spots == 13 and s.warning is None
    # the pixels whose Bragg part is >= 3 sqrt(20): a radius of about 2.6 pixels around each spot
    assert 12 * 18 < s.signal_pixels < 13 * 26
    assert s.to_dict() == {"signal_pixels": s.signal_pixels, "signal_spots": 13, "parameters": 2,
                           "spots_per_parameter": 6.5, "support_warning": None}
    with caplog.at_level("WARNING", logger="refine.quality.fit_quality"):
        few = signal_support(model, 20.0, mask, 3)
    assert 13 < MIN_SPOTS_PER_PARAMETER * 3 and few.warning.startswith("only 13 spots")
    assert "3 refined parameters" in few.warning and "\n" not in few.warning
    assert few.warning in caplog.text
    # pixels not fitted do not count, and a planar background is taken off before the threshold
    mask[:, 32:] = False
    assert signal_support(model, 20.0, mask, 1).spots == 7
    from refine.quality.fit_quality import background_image

    bg = background_image(model.shape, {"background": 20.0, "background_x": 2.0, "background_y": -1.0})
    assert bg[0, 0] == pytest.approx(20.0 - 2.0 * 31.5 + 31.5) and bg.mean() == pytest.approx(20.0)
    assert signal_support(model - 20.0 + bg, bg, np.ones(model.shape, bool), 2).spots == 13


def test_refinement_result_reports_the_signal_support(problem_cache):
    from refine.quality.fit_quality import MIN_SPOTS_PER_PARAMETER

    problem = problem_cache("cubic_mosflm", 64)
    full = refine(problem, start=problem.truth, stages=(Stage("scale", ("scale", "background")),), progress=False,
                  esds=False)
    assert full.fit["signal_spots"] >= MIN_SPOTS_PER_PARAMETER * 2 and full.fit["support_warning"] is None
    assert full.fit["signal_pixels"] > full.fit["signal_spots"] and full.fit["parameters"] == 2
    # a corner of the image, where a spot or two remain, for three parameters
    corner = np.zeros(problem.observed.shape, dtype=bool)
    corner[:12, :12] = True
    few = refine(problem, start=problem.truth, mask=corner, stages=(Stage("s", ("scale", "background", "cell_a")),),
                 progress=False, esds=False)
    assert few.fit["signal_spots"] < MIN_SPOTS_PER_PARAMETER * 3 and few.fit["parameters"] == 3
    assert few.fit["support_warning"] in few.warnings and "refined parameters" in few.fit["support_warning"]
    doc = few.to_json_dict()
    assert doc["fit"]["signal_spots"] == few.fit["signal_spots"] and few.fit["support_warning"] in doc["warnings"]
