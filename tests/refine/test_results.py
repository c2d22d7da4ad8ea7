"""The front door end to end on a small problem: result contents, result files, checkpoints and resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from nbtorch.parameters import PARAMETER_NAMES
from refine import (
    AbstractCallback, Convergence, RefinementInterrupted, Stage, Status, load_h5, read_checkpoint, refine, save_h5,
    save_json,
    stage_a,
)
from refine.solver.checkpoint import write_checkpoint
from refine.solver.stages import coarse_to_fine

STAGES = stage_a(max_steps=8, final_steps=30)


@pytest.fixture(scope="module")
def small(problem_cache):
    return problem_cache("tetragonal_mosflm", 32)


@pytest.fixture(scope="module")
def result(small):
    torch.set_num_threads(1)
    return refine(small, stages=STAGES, progress=False)


def test_result_contents(small, result):
    assert result.status.ok
    assert set(PARAMETER_NAMES) <= set(result.params) and {"scale", "background"} <= set(result.params)
    assert "background_x" not in result.params  # constant background
    assert result.params["N_a"] == result.params["N_b"] == result.params["N_c"]  # isotropic N
    assert result.params["cell_a"] == result.params["cell_b"]  # tetragonal
    assert result.params["cell_alpha"] == 90.0 and result.params["distance"] == small.truth["distance"]
    assert result.initial_params["cell_a"] == pytest.approx(small.start["cell_a"])
    assert result.free == ("cell_a", "cell_c", "mosaic_spread", "beam_x", "beam_y", "orient_x", "orient_y",
                           "orient_z", "scale", "background", "N")
    for name in result.free + ("cell_b", "N_a", "N_b", "N_c", "misset_x", "misset_y", "misset_z"):
        assert result.esds[name] > 0 and math.isfinite(result.esds[name])
    assert result.esds["cell_b"] == result.esds["cell_a"]
    assert result.units["cell_a"] == "A" and result.units["beam_x"] == "mm" and result.units["misset_x"] == "deg"
    P = len(result.free)
    assert result.correlation.shape == (P, P) and np.allclose(np.diag(result.correlation), 1.0)
    assert result.model.shape == result.observed.shape == result.residuals.shape == (32, 32)
    assert np.allclose(result.residuals, result.observed - result.model)
    assert result.loss_final < result.loss_initial
    assert [s.name for s in result.stages] == [s.name for s in STAGES]
    n = len(result.history["step"])
    assert n == sum(s.steps + 1 for s in result.stages)  # a start row per stage plus one per step
    assert result.history["step"] == list(range(n))
    assert all(len(col) == n for col in result.history["params"].values())
    assert result.steps == sum(s.steps for s in result.stages)
    assert "cell_a" in result.summary()


def test_result_files(tmp_path, result):
    jpath = save_json(result, tmp_path / "result.json")
    doc = json.loads(jpath.read_text())
    for key in ("params", "esds", "initial_params", "loss_initial", "loss_final", "steps", "status", "wall_s"):
        assert key in doc
    assert set(PARAMETER_NAMES) <= set(doc["params"])
    assert doc["status"] == result.status.value and doc["params"]["cell_a"] == result.params["cell_a"]
    assert doc["correlation"]["names"] == list(result.free)
    hpath = save_h5(result, tmp_path / "result.h5")
    back = load_h5(hpath)
    assert back["status"] == result.status.value and back["steps"] == result.steps
    assert back["params"] == pytest.approx(result.params) and back["esds"] == pytest.approx(result.esds)
    assert back["names"] == list(result.free)
    assert np.array_equal(back["images"]["model"], result.model)
    assert np.array_equal(back["images"]["residuals"], result.residuals)
    assert np.array_equal(back["history"]["loss"], np.asarray(result.history["loss"]))
    assert np.array_equal(back["history"]["params"]["cell_a"], np.asarray(result.history["params"]["cell_a"]))
    assert back["json"]["params"] == doc["params"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.h5", "result.json"]  # atomic: no temporaries


class _CtrlC(AbstractCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step(self, state) -> None:
        if state.step == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("at", [0, 11, 30])
def test_interrupt_and_resume_gives_the_same_result(tmp_path, small, result, at):
    ckpt = tmp_path / "ckpt.h5"
    with pytest.raises(RefinementInterrupted) as info:
        refine(small, stages=STAGES, progress=False, checkpoint=ckpt, checkpoint_every=4, callbacks=[_CtrlC(at)])
    assert isinstance(info.value, KeyboardInterrupt) and info.value.checkpoint == ckpt
    saved = read_checkpoint(ckpt)
    assert len(saved.history["step"]) == at + 1  # the interrupted step is complete and kept
    resumed = refine(small, stages=STAGES, progress=False, checkpoint=ckpt, resume=ckpt)
    assert resumed.status == result.status
    assert resumed.params == result.params  # bit for bit
    assert resumed.loss_final == result.loss_final and resumed.steps == result.steps
    assert resumed.history["loss"] == result.history["loss"]
    assert resumed.wall_s > 0


def test_resume_rejects_another_problem(tmp_path, small, problem_cache):
    ckpt = tmp_path / "ckpt.h5"
    with pytest.raises(RefinementInterrupted):
        refine(small, stages=STAGES, progress=False, checkpoint=ckpt, callbacks=[_CtrlC(2)])
    other = problem_cache("cubic_mosflm", 32)
    with pytest.raises(ValueError, match="another problem"):
        refine(other, stages=STAGES, progress=False, resume=ckpt)
    with pytest.raises(ValueError, match="not found"):
        refine(small, stages=STAGES, progress=False, resume=tmp_path / "missing.h5")


def test_front_door_with_a_simulator_and_bad_inputs(small):
    sim = small.simulator()
    one = (Stage("beam", ("scale", "background", "beam_centre"), bin=2),)
    res = refine(sim, small.observed, start={"scale": 3.0}, symmetry="tetragonal", stages=one, progress=False,
                 mask=np.ones(sim.shape, dtype=bool))
    assert res.status.ok and res.free == ("beam_x", "beam_y", "scale", "background")
    assert res.initial_params["background"] == pytest.approx(float(np.median(small.observed)))
    with pytest.raises(ValueError, match="observed: shape"):
        refine(sim, small.observed[:10], stages=one, progress=False)
    with pytest.raises(ValueError, match="observed: an observed image"):
        refine(sim, stages=one, progress=False)
    with pytest.raises(ValueError, match="breaks the cubic"):
        refine(sim, small.observed, symmetry="cubic", stages=one, progress=False)
    with pytest.raises(ValueError, match="nothing to refine"):
        refine(sim, small.observed, fixed=("beam_centre", "scale", "background"), stages=one, progress=False)
    with pytest.raises(ValueError, match="start: unknown"):
        refine(sim, small.observed, start={"cell_d": 1.0}, stages=one, progress=False)
    with pytest.raises(ValueError, match="mask"):
        refine(sim, small.observed, mask=np.ones((3, 3), dtype=bool), stages=one, progress=False)


def test_nan_pixels_are_ignored_and_status_reported(small):
    obs = small.observed.copy()
    obs[0, :5] = np.nan
    obs[1, :5] = -3.0
    one = (Stage("beam", ("scale", "background", "beam_centre"), bin=2),)
    res = refine(small, obs, stages=one, progress=False, time_budget_s=1e-9)
    assert res.status is Status.TIME_BUDGET and "time budget" in res.message
    assert not res.mask[0, :5].any() and not res.mask[1, :5].any() and res.mask[5:, 5:].all()


def test_planar_background_bounds_and_other_losses(small):
    one = (Stage("nuisance", ("scale", "background", "beam_centre"), bin=2, convergence=Convergence(max_steps=15)),)
    res = refine(small, stages=one, background="planar", progress=False)
    assert {"background_x", "background_y"} <= set(res.free) and "background_x" in res.params
    assert abs(res.params["background_x"]) < 0.05 and res.esds["background_y"] > 0
    lo, hi = small.truth["beam_x"] - 0.05, small.truth["beam_x"] + 0.5
    res = refine(small, stages=one, bounds={"beam_x": (lo, hi)}, progress=False)
    assert lo < res.params["beam_x"] < hi
    res = refine(small, stages=one, loss="gaussian", progress=False, esds=False)
    assert res.status.ok and res.loss_final < res.loss_initial and res.hparams["loss"] == "gaussian"
    with pytest.raises(ValueError, match="background"):
        refine(small, stages=one, background="quadratic", progress=False)


class _Crash(AbstractCallback):
    """A process killed between two stages: the run stops at stage ``index``'s start, after the checkpoint
    written at the end of the stage before."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_stage_start(self, stage, index) -> None:
        if index == self.index:
            raise RuntimeError("killed")


def test_a_run_killed_between_coarse_stages_resumes_with_the_carried_lbfgs_memory(tmp_path, small):
    """coarse_to_fine's copies hand their LBFGS memory to the next stage; the checkpoint written between two
    stages keeps it, so a run killed there resumes to the uninterrupted result bit for bit (and the memory
    matters: a resume without it takes other steps)."""
    stages = coarse_to_fine(Stage("all", ("scale", "background", "orientation", "beam_centre", "cell", "mosaic"),
                                  convergence=Convergence(max_steps=12)))
    whole = refine(small, stages=stages, progress=False)
    ckpt = tmp_path / "ckpt.h5"
    with pytest.raises(RuntimeError, match="killed"):
        refine(small, stages=stages, progress=False, checkpoint=ckpt, callbacks=[_Crash(2)])
    saved = read_checkpoint(ckpt)
    assert saved.stage_index == 2 and saved.loop is None and saved.memory is not None
    resumed = refine(small, stages=stages, progress=False, checkpoint=ckpt, resume=ckpt)
    assert resumed.params == whole.params and resumed.history["loss"] == whole.history["loss"]
    saved.memory = None  # the same checkpoint without the memory: the last stage starts cold
    write_checkpoint(ckpt, saved)
    cold = refine(small, stages=stages, progress=False, checkpoint=ckpt, resume=ckpt)
    assert cold.history["loss"] != whole.history["loss"]


def test_resume_of_a_checkpoint_written_before_newer_canonical_names(tmp_path, small, result):
    """A checkpoint of an earlier nbtorch lacks the names added since (here the anisotropic mosaic's and the beam's
    widths): the resumed run takes the model's values for them and ends where an uninterrupted run ends."""
    ckpt = tmp_path / "ckpt.h5"
    with pytest.raises(RefinementInterrupted):
        refine(small, stages=STAGES, progress=False, checkpoint=ckpt, checkpoint_every=4, callbacks=[_CtrlC(11)])
    saved = read_checkpoint(ckpt)
    newer = ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c", "dispersion", "divergence_h", "divergence_v")
    for values in (saved.stage_values, saved.initial_values):
        for n in newer:
            values.pop(n)
    write_checkpoint(ckpt, saved)
    assert not set(newer) & set(read_checkpoint(ckpt).stage_values)
    resumed = refine(small, stages=STAGES, progress=False, checkpoint=ckpt, resume=ckpt)
    assert resumed.params == result.params and resumed.loss_final == result.loss_final
