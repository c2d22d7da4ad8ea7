"""The named steps of a run (plan, history, stages, finalise), the public pixel choice and the priors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from refine import Convergence, make_problem, refine, single_stage
from refine.solver.history import History
from refine.inputs.pixels import check_pixel_options, choose_pixels, starting_scale_background
from refine.solver.plan import RunPlan, make_plan
from refine.inputs.selection import resolution_mask, subsample_mask

MODEL = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -N 12 -default_F 100 -oversample 1 "
         "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48")


# ----------------------------------------------------------------------------- history

def test_history_pads_late_names_and_truncates_for_checkpoints():
    h = History()
    assert h.append(0, 0, 10.0, 1.0, {"a": 1.0}) == 0
    h.append(0, 1, 9.0, 0.5, {"a": 1.1})
    h.append(1, 0, 8.0, 0.4, {"a": 1.1, "b": 7.0})  # b first seen: padded backwards with its value
    d = h.to_dict()
    assert d["step"] == [0, 1, 2] and d["stage"] == [0, 0, 1] and d["stage_step"] == [0, 1, 0]
    assert d["params"]["b"] == [7.0, 7.0, 7.0]
    assert h.first_loss(1) == 8.0 and h.first_loss(2) is None
    assert h.up_to(1, -1).to_dict()["step"] == [0, 1]          # a stage boundary: none of stage 1
    assert h.up_to(0, 0).to_dict()["loss"] == [10.0]            # inside stage 0, up to its step 0
    assert History(d).to_dict() == d                             # the stored form reads back


def test_history_keeps_the_loop_time_of_each_row(tmp_path):
    """``elapsed_s``: the stage's loop time at each row (row 0 its first evaluation), in the result and its file;
    a stored history from before the column reads back with NaN there."""
    from refine.output.result_files import load_h5, save_h5

    problem = make_problem("cubic_mosflm", size=16)
    result = refine(problem, stages=single_stage(["scale", "background", "cell"], "lbfgs", Convergence(max_steps=3)),
                    progress=False)
    elapsed = result.history["elapsed_s"]
    assert len(elapsed) == len(result.history["step"]) >= 2
    assert all(np.isfinite(elapsed)) and elapsed[0] > 0 and all(np.diff(elapsed) >= 0)
    save_h5(result, tmp_path / "r.h5")
    assert np.array_equal(load_h5(tmp_path / "r.h5")["history"]["elapsed_s"], elapsed)
    old = {k: v for k, v in History(result.history).to_dict().items() if k != "elapsed_s"}
    assert np.isnan(History(old).to_dict()["elapsed_s"]).all()


# ----------------------------------------------------------------------------- plan

def test_plan_is_frozen_and_checked():
    problem = make_problem("cubic_mosflm", size=16)
    plan = make_plan(problem, stages=single_stage(["scale", "background", "cell"], "lbfgs", Convergence(max_steps=2)))
    assert isinstance(plan, RunPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.symmetry = "triclinic"
    assert plan.names and all(n in plan.start for n in ("scale", "background"))
    assert "priors" not in plan.fingerprint
    with pytest.raises(InputError, match="start: unknown parameter 'wobble'"):
        make_plan(problem, start={"wobble": 1.0})
    with pytest.raises(InputError, match="observed: shape"):
        make_plan(problem.simulator(), np.zeros((3, 3)))
    with pytest.raises(InputError, match="priors: unknown parameter 'wobble'"):
        make_plan(problem, priors={"wobble": (1.0, 1.0)})
    with pytest.raises(InputError, match="nothing to refine"):
        make_plan(problem, stages=single_stage(["cell"]), fixed=("cell",))
    with_prior = make_plan(problem, priors={"cell_a": (45.0, 0.1)})
    assert with_prior.fingerprint["priors"] == {"cell_a": [45.0, 0.1]}


# ----------------------------------------------------------------------------- priors

def test_a_tight_prior_holds_the_value_and_its_esd():
    """A prior far tighter than the data pins the refined value at its mean and its esd near sigma;
    without it the same run moves away."""
    problem = make_problem("cubic_mosflm", size=24)
    stages = single_stage(["scale", "background", "cell"], "lbfgs", Convergence(max_steps=30))
    free = refine(problem, stages=stages, progress=False)
    mean = free.initial_params["cell_a"]
    sigma = 1e-5
    held = refine(problem, stages=stages, progress=False, priors={"cell_a": (mean, sigma)})
    assert abs(free.params["cell_a"] - mean) > 20 * sigma  # the data alone move it
    assert held.params["cell_a"] == pytest.approx(mean, abs=5 * sigma)
    assert held.esds["cell_a"] <= 1.01 * sigma


# ----------------------------------------------------------------------------- pixels

@pytest.fixture(scope="module")
def sim_and_image():
    sim = Simulator(config_from_args(MODEL.split()), compile=False)
    img, _ = sim.render()
    return sim, img.detach().numpy() + 1.0


def test_choose_pixels_combines_like_the_command(sim_and_image):
    sim, image = sim_and_image
    mask = np.ones(image.shape, dtype=bool)
    mask[:, :4] = False
    choice = choose_pixels(sim, image, mask, dmin_A=1.5, subsample=0.5, seed=3)
    expected = subsample_mask(mask & resolution_mask(sim, 1.5, None, sim.setup.roi), 0.5, 3)
    assert np.array_equal(choice.mask, expected) and choice.spots is None
    assert choice.n_used == int(expected.sum()) and 0 < choice.fraction < 1
    restricted = choice.simulator(sim)
    assert restricted is not sim and sim.setup.pixel_mask is None
    whole = choose_pixels(sim, image)
    assert whole.n_used == image.size and whole.simulator(sim) is sim


def test_choose_pixels_spot_windows(sim_and_image):
    sim, image = sim_and_image
    spots = np.array([[10.5, 12.5], [30.5, 20.5], [1000.0, 1000.0]])  # the last one is off the detector
    choice = choose_pixels(sim, image, spots=spots, spot_window_px=2)
    assert len(choice.spots) == 2
    assert choice.n_used == 2 * 25
    assert choice.mask[12, 10] and choice.mask[20, 30] and not choice.mask[0, 0]
    with pytest.raises(InputError, match="--spots obs.txt: no spot inside the fitted region"):
        choose_pixels(sim, image, spots=spots[2:], spots_source="--spots obs.txt")
    with pytest.raises(InputError, match="spots: no spot inside"):  # none found at all
        choose_pixels(sim, image, spots=np.zeros((0, 2)))


@pytest.mark.parametrize("kwargs, message", [
    ({"subsample": 0.0}, "--subsample: fraction must be in"),
    ({"spot_window_px": 3}, "--spot-window needs --spots"),
    ({"spot_window_px": -1, "spots": np.zeros((1, 2))}, "--spot-window: must be >= 0"),
])
def test_choose_pixels_refuses_bad_options(sim_and_image, kwargs, message):
    sim, image = sim_and_image
    with pytest.raises(InputError, match=message):
        choose_pixels(sim, image, **kwargs)
    with pytest.raises(InputError, match=message):
        check_pixel_options(kwargs.get("subsample"), kwargs.get("spot_window_px"), "spots" in kwargs)


def test_no_pixel_left(sim_and_image):
    sim, image = sim_and_image
    with pytest.raises(InputError, match="no pixel left to fit"):
        choose_pixels(sim, image, np.zeros(image.shape, dtype=bool))


def test_starting_scale_background_keeps_given_values(sim_and_image):
    sim, image = sim_and_image
    pixels = np.ones(image.shape, dtype=bool)
    start = starting_scale_background(sim, 3.0 * (image - 1.0) + 2.0, pixels)
    assert start["scale"] == pytest.approx(3.0, rel=1e-3) and start["background"] == pytest.approx(2.0, rel=1e-3)
    kept = starting_scale_background(sim, image, pixels, {"scale": 7.0})
    assert kept["scale"] == 7.0 and "background" in kept
    assert starting_scale_background(sim, image, pixels, {"scale": 7.0, "background": 1.0}) == {
        "scale": 7.0, "background": 1.0}
