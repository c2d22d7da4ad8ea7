"""Say when the data cannot decide (#17): too few spots per refined parameter, spots drifting away."""

from __future__ import annotations

import pytest

from nbtorch.errors import InputError
from refine import Convergence, make_problem, refine, single_stage
from refine.quality.identifiability import FIX_ORDER, drift_warning, reduce_free
from refine.solver.plan import make_plan

NAMES = ("scale", "background", "orient_x", "orient_y", "orient_z", "cell_a", "cell_c", "mosaic_spread",
         "beam_x", "beam_y")


def test_enough_spots_change_nothing():
    assert reduce_free(NAMES, 40) == ((), None)  # 5 for each of the 8 names the spots decide
    assert reduce_free(NAMES, 40, "fail") == ((), None)


def test_fix_drops_the_least_determined_names_first():
    fixed, message = reduce_free(NAMES, 26)  # 8 names the spots decide; 26 spots: 5 at most
    assert fixed == ("mosaic_spread", "cell_c", "cell_a")
    assert [FIX_ORDER.index(n) for n in fixed] == sorted(FIX_ORDER.index(n) for n in fixed)
    assert "26 observed spots" in message and "for 8 refined parameters" in message and "fixed mosaic_spread, cell_c, cell_a" in message
    assert "\n" not in message


def test_fix_never_fixes_scale_background_or_orientation():
    fixed, message = reduce_free(NAMES, 2)
    assert not set(fixed) & {"scale", "background", "orient_x", "orient_y", "orient_z"}
    assert set(fixed) == {"mosaic_spread", "cell_c", "cell_a", "beam_x", "beam_y"}
    assert "still 2 spots for 3 parameters" in message


def test_warn_and_fail():
    fixed, message = reduce_free(NAMES, 10, "warn")
    assert fixed == () and "may not decide" in message
    with pytest.raises(InputError, match="10 observed spots in the fitted region for 8 refined parameters"):
        reduce_free(NAMES, 10, "fail")
    with pytest.raises(InputError, match="too_few_spots: expected one of fix, warn, fail"):
        reduce_free(NAMES, 10, "drop")


def test_drift_warning_only_when_the_loss_fell_and_the_spots_moved_away():
    assert drift_warning(1.0, 0.8, 20, 100.0, 50.0) is None          # both better
    assert drift_warning(1.0, 1.05, 20, 100.0, 50.0) is None         # within the tolerance
    assert drift_warning(1.0, 2.0, 20, 100.0, 120.0) is None         # the loss rose: another problem
    assert drift_warning(1.0, 2.0, 0, 100.0, 50.0) is None           # no spot matched before and after
    text = drift_warning(1.0, 2.0, 20, 100.0, 50.0)
    assert "moved away from the observed ones (rms 1 -> 2 px over 20 spots)" in text and "\n" not in text


def test_refine_fixes_parameters_the_spots_cannot_decide():
    problem = make_problem("cubic_mosflm", size=16)
    stages = single_stage(["scale", "background", "cell", "orientation", "beam_centre"], "lbfgs",
                          Convergence(max_steps=2))
    plan = make_plan(problem, stages=stages, n_spots=20)  # 20 spots: 4 parameters besides scale and background
    assert "cell_a" not in plan.names and "beam_x" not in plan.names
    assert (len(plan.names) - 2) * 5 <= 20 and plan.warnings
    result = refine(problem, stages=stages, n_spots=20, progress=False, esds=False)
    assert "cell_a" not in result.free and any("fixed" in w for w in result.warnings)
    assert result.params["cell_a"] == result.initial_params["cell_a"]
    with pytest.raises(InputError, match="the spots cannot decide them all"):
        make_plan(problem, stages=stages, n_spots=20, too_few_spots="fail")
