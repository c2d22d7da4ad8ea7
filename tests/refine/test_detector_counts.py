"""Detector counts: ``counts = gain * photons + adc_offset`` (refine.inputs.detector_counts).

The header's constants per format, the conversion and its mask, the checks, a refinement of an image recorded
with gain 2 and a 40-count offset (fit at the noise level, the truth recovered), and the objective's gradient
against finite differences on such an image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbtorch.errors import InputError
from nbtorch.io import write_cbf
from nbtorch.io.smv import smv_header_from_geometry, write_smv
from refine.inputs.detector_counts import NANOBRAGG_ADC, DetectorCounts, check_counts, detector_counts, header_counts
from refine.inputs.images import load_image

F64 = torch.float64


def _counts_of(path):
    obs = load_image(path)
    return header_counts(obs.path, obs.format, obs.header)


def test_smv_header_keys_give_gain_and_offset(tmp_path):
    image = np.full((8, 8), 50, dtype=np.uint16)
    write_smv(tmp_path / "keys.img", image, {"GAIN": "2.5", "IMAGE_PEDESTAL": "37", "ADC_OFFSET": "12"})
    c = _counts_of(tmp_path / "keys.img")
    assert (c.gain, c.adc_offset) == (2.5, 37.0)  # IMAGE_PEDESTAL is taken before ADC_OFFSET
    assert "GAIN=2.5" in c.source and "IMAGE_PEDESTAL=37" in c.source
    write_smv(tmp_path / "offset.img", image, {"ADC_OFFSET": "12"})
    assert (_counts_of(tmp_path / "offset.img").gain, _counts_of(tmp_path / "offset.img").adc_offset) == (1.0, 12.0)
    write_smv(tmp_path / "bad.img", image, {"GAIN": "0"})
    with pytest.raises(InputError, match=r"bad.img: SMV header GAIN='0' is not a usable gain"):
        _counts_of(tmp_path / "bad.img")


def test_nanobragg_smv_plain_smv_and_pilatus(tmp_path):
    header = smv_header_from_geometry(fpixels=8, spixels=8, pixel_mm=0.1, distance_mm=100.0, wavelength_A=1.0,
                                      beam_center_x_mm=0.4, beam_center_y_mm=0.4, adxv_x=0.4, adxv_y=0.4,
                                      mosflm_x=0.4, mosflm_y=0.4, denzo_x=0.4, denzo_y=0.4,
                                      dials_origin=(-0.4, 0.4, -100.0), xds_orgx=4.0, xds_orgy=4.0,
                                      close_distance_mm=100.0, phi_deg=0.0, osc_start_deg=0.0, osc_range_deg=0.0,
                                      twotheta_deg=0.0)
    write_smv(tmp_path / "nb.img", np.full((8, 8), 45, dtype=np.uint16), header)
    c = _counts_of(tmp_path / "nb.img")
    assert (c.gain, c.adc_offset) == (1.0, NANOBRAGG_ADC) and "nanoBragg" in c.source
    write_smv(tmp_path / "plain.img", np.full((8, 8), 45, dtype=np.uint16))
    assert _counts_of(tmp_path / "plain.img").identity
    write_cbf(tmp_path / "p.cbf", np.ones((8, 8), dtype=np.int32), {"pixel_size_mm": 0.172})
    assert _counts_of(tmp_path / "p.cbf").identity


def test_photons_mask_values_and_overrides():
    c = DetectorCounts(2.0, 40.0, "test")
    counts = np.array([[40.0, 50.0], [38.0, 100.0]])
    photons, mask, below = c.photons(counts, np.array([[True, True], [True, False]]))
    assert np.array_equal(photons, [[0.0, 5.0], [-1.0, 30.0]])
    assert mask.tolist() == [[True, True], [False, False]] and below == 1  # below the offset: masked and counted
    assert c.photon_values({"scale": 3.0, "background": 50.0, "background_x": 0.2, "cell_a": 7.0}) == {
        "scale": 1.5, "background": 5.0, "background_x": 0.1, "cell_a": 7.0}
    same = DetectorCounts()
    out, keep, n = same.photons(counts)
    assert np.array_equal(out, counts) and keep.all() and n == 0
    over = detector_counts(c, adc_offset=0.0)
    assert (over.gain, over.adc_offset) == (2.0, 0.0) and over.source.startswith("--adc-offset 0")
    assert detector_counts(c) is c


@pytest.mark.parametrize("gain, offset, message", [(0.0, None, "--gain: counts per photon must be a finite number > 0"),
                                                   (-1.0, None, "--gain"), (float("nan"), None, "--gain"),
                                                   (float("inf"), None, "--gain"),
                                                   (None, float("nan"), "--adc-offset: counts must be a finite"),
                                                   (None, float("-inf"), "--adc-offset")])
def test_bad_values_are_one_line_errors(gain, offset, message):
    with pytest.raises(InputError, match=message):
        check_counts(gain, offset)


def _gain2_photons(problem):
    """The problem's image as a detector with gain 2 and a 40-count offset records it, turned back into photons."""
    counts = 2.0 * (problem.observed - problem.pedestal) + 40.0
    photons, mask, below = DetectorCounts(2.0, 40.0).photons(counts)
    assert below == 0 and not np.array_equal(photons, counts)
    return photons


def _check_truth(problem, result):
    truth = problem.counts.photon_values(problem.truth)
    assert truth["background"] == 5.0
    assert 0.8 < result.fit["excess"] < 1.25, result.fit  # with the pedestal left in: 0.475
    for name in ("cell_a", "cell_c", "scale", "background", "beam_x", "beam_y"):
        err = result.params[name] - truth[name]
        assert abs(err) <= 3 * result.esds[name], (name, result.params[name], truth[name], result.esds[name])


def test_gain_2_and_offset_40_fit_to_the_noise_from_the_truth(problem_cache):
    """From the truth (in photons): a conversion that missed the gain or the offset would move scale to 2 or the
    background to 45 and the excess away from 1."""
    from refine import refine, single_stage
    from refine.solver.loop import Convergence

    problem = problem_cache("tetragonal_mosflm", 32)
    result = refine(problem.simulator(), _gain2_photons(problem), start=problem.counts.photon_values(problem.truth),
                    symmetry=problem.symmetry, fixed=problem.fixed, progress=False,
                    stages=single_stage(("scale", "background", "cell", "beam_centre"), "lbfgs",
                                        Convergence(max_steps=30)))
    _check_truth(problem, result)


def test_refine_of_a_problem_fits_photons_and_a_given_image_as_it_is(problem_cache):
    """``refine(problem)`` fits the problem's counts as photons (its pedestal off, the start's background and the
    caller's ``start`` converted), as ``nbtorch-refine --problem``; an ``observed`` given is fitted as it is."""
    from refine import refine, single_stage
    from refine.solver.loop import Convergence

    problem = problem_cache("tetragonal_mosflm", 32)
    stages = single_stage(("scale", "background", "cell", "beam_centre"), "lbfgs", Convergence(max_steps=30))
    result = refine(problem, start=problem.truth, stages=stages, progress=False)
    _check_truth(problem, result)
    assert result.initial_params["background"] == 5.0  # the caller's start (counts: 45) in photons
    counts = refine(problem, problem.observed, start=problem.truth, stages=stages, progress=False, esds=False)
    assert counts.params["background"] == pytest.approx(45.0, abs=0.5) and counts.fit["excess"] < 0.7


@pytest.mark.slow
def test_gain_2_and_offset_40_refine_to_the_truth(problem_cache):
    """The bank's refinement from its perturbed start (about a minute on a busy 2-core machine)."""
    from refine import refine

    problem = problem_cache("tetragonal_mosflm", 64)
    result = refine(problem.simulator(), _gain2_photons(problem), start=problem.counts.photon_values(problem.start),
                    free=problem.free, fixed=problem.fixed, symmetry=problem.symmetry, progress=False)
    _check_truth(problem, result)


def test_objective_gradient_matches_finite_differences_with_gain_2(problem_cache):
    from refine.fitting.objective import ImageObjective, make_view

    problem = problem_cache("tetragonal_mosflm", 32)
    sim = problem.simulator()
    photons = torch.as_tensor(_gain2_photons(problem))
    base = problem.counts.photon_values(problem.start)
    vals = {n: torch.tensor(float(base[n]), dtype=F64) for n in base}
    vals["beam_x"] = vals["beam_x"] + 0.05
    view = make_view(sim, {k: float(v) for k, v in vals.items()}, torch.ones(sim.shape, dtype=torch.bool))
    objective = ImageObjective(sim, photons, view)
    names = ("cell_a", "beam_x", "scale", "background")
    leaves = {k: v.clone().requires_grad_(k in names) for k, v in vals.items()}
    loss, _ = objective.evaluate(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    for name, g in zip(names, grads):
        h = 1e-5 * max(1.0, abs(float(vals[name])))
        up = {**vals, name: vals[name] + h}
        down = {**vals, name: vals[name] - h}
        with torch.no_grad():
            fd = (float(objective.evaluate(up)[0]) - float(objective.evaluate(down)[0])) / (2 * h)
        assert float(g) != 0.0, name
        assert float(g) == pytest.approx(fd, rel=1e-5, abs=1e-6), name


def test_multi_panel_cbf_says_its_gain_is_assumed():
    """A multi-array imgCIF (a CSPAD's) records no gain: 1 and 0 are assumed and the source says so (not 'a photon
    counter', which a mini-CBF's Pilatus is)."""
    c = header_counts("cspad.cbf", "cbf", {"panel_boxes": [("A", 0, 0, 4, 4)], "binary": {}})
    assert (c.gain, c.adc_offset) == (1.0, 0.0) and "--gain" in c.source and "photon counter" not in c.source
    assert "photon counter" in header_counts("mini.cbf", "cbf", {"binary": {}}).source
