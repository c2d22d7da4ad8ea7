"""One table of the canonical parameters (nbtorch.parameters): every consumer agrees with it."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

import nbtorch
import nbtorch.rules.resolve
from nbtorch import Simulator, config_from_args
from nbtorch.errors import InputError
from nbtorch.parameters import (
    EXTRA_TABLE, MISSET_NAMES, ORIENTATION_DELTAS, PARAMETER_NAMES, SIMULATOR_NAMES, TABLE, UNITS as TABLE_UNITS,
    Parameter, names_in_group, parameter,
)
from refine.fitting import parameters as rp
from refine.output.callbacks import StepState, TensorBoardCallback, parameter_tag
from refine.solver.loop import Status
from refine.output.results import RefinementResult, save_h5, save_json

ARGS = "-cell 50 60 70 90 90 90 -N 3 -lambda 1.0 -default_F 10 -distance 80 -detpixels 8"


def test_table_shape():
    names = [p.name for p in TABLE + EXTRA_TABLE]
    assert len(names) == len(set(names)) == 37
    assert names_in_group("beam") == ("wavelength", "fluence", "polarization", "dispersion", "divergence_h", "divergence_v")
    assert PARAMETER_NAMES == tuple(p.name for p in TABLE)
    assert SIMULATOR_NAMES == PARAMETER_NAMES + ORIENTATION_DELTAS == tuple(names)
    assert set(MISSET_NAMES) <= set(PARAMETER_NAMES) and parameter("misset_y").unit == "deg"
    assert names_in_group("detector") == ("distance", "beam_x", "beam_y", "detector_rotx", "detector_roty",
                                          "detector_rotz", "twotheta")
    assert TABLE_UNITS == {p.name: p.unit for p in TABLE + EXTRA_TABLE}
    with pytest.raises(KeyError, match="unknown parameter 'cell_d'"):
        parameter("cell_d")
    with pytest.raises(ValueError, match="unknown step kind"):
        Parameter("x", "mm", "detector", "sideways", 1.0, "")


def test_nbtorch_consumers():
    """nbtorch.rules.resolve and nbtorch re-export the table's names; Setup.params and the simulator follow it."""
    assert nbtorch.PARAMETER_NAMES is PARAMETER_NAMES and nbtorch.rules.resolve.PARAMETER_NAMES is PARAMETER_NAMES
    sim = Simulator(config_from_args(ARGS.split()), compile=False)
    assert tuple(sim.setup.params) == PARAMETER_NAMES
    assert tuple(sim.parameters_dict()) == SIMULATOR_NAMES
    with pytest.raises(InputError, match="unknown parameter name"):
        sim.parameters_dict(cell_d=1.0)


def test_refine_units_steps_and_groups_read_the_table():
    for p in TABLE + EXTRA_TABLE + rp.REFINE_TABLE:
        assert rp.UNITS[p.name] == p.unit
        if p.name != "polarization":
            assert rp.STEPS[p.name] == ("mul" if p.step_kind == "relative" else "add", p.step)
    assert set(rp.UNITS) == set(rp.REFINABLE)
    assert rp.BASE_NAMES == SIMULATOR_NAMES + rp.NUISANCE
    assert rp.GROUPS["detector"] == names_in_group("detector") and rp.CELL == names_in_group("cell")
    assert rp.GROUPS["orientation"] == ORIENTATION_DELTAS
    assert rp.units_of(["beam_x", "scale", "nonsense"]) == {"beam_x": "mm", "scale": "1"}


def _result(units: dict) -> RefinementResult:
    params = {n: 1.0 for n in PARAMETER_NAMES} | {"scale": 1.0, "background": 2.0}
    free = ("beam_x", "orient_x", "N")
    return RefinementResult(
        status=Status.CONVERGED, message="ok", params=params, initial_params=dict(params),
        refined={n: 0.0 for n in free}, esds={n: 0.1 for n in free}, units=units, free=free,
        correlation=np.eye(3), covariance=np.eye(3), fisher_condition=1.0, loss_initial=2.0, loss_final=1.0,
        steps=1, evaluations=1, wall_s=0.0, stages=(),
        history={"step": [0], "stage": [0], "stage_step": [0], "loss": [1.0], "grad_norm": [0.0], "params": {}},
        observed=np.zeros((2, 2)), model=np.zeros((2, 2)), residuals=np.zeros((2, 2)),
        mask=np.ones((2, 2), dtype=bool))


def test_result_files_carry_the_table_units(tmp_path):
    result = _result(rp.units_of(list(PARAMETER_NAMES) + ["scale", "background", "beam_x", "orient_x", "N"]))
    doc = json.loads(save_json(result, tmp_path / "r.json").read_text())
    for name, unit in doc["units"].items():
        assert unit == rp.UNITS[name]
    assert {n: doc["units"][n] for n in PARAMETER_NAMES} == {p.name: p.unit for p in TABLE}
    with h5py.File(save_h5(result, tmp_path / "r.h5"), "r") as h5:
        for name in PARAMETER_NAMES:
            assert h5["params"][name].attrs["units"] == parameter(name).unit
        assert h5["esds"]["orient_x"].attrs["units"] == "deg" and h5["esds"]["N"].attrs["units"] == "unit cells"


class _Writer:
    def __init__(self) -> None:
        self.tags: list[str] = []

    def add_scalar(self, tag, value, step) -> None:
        self.tags.append(tag)


def test_tensorboard_tags_are_table_names():
    writer = _Writer()
    cb = TensorBoardCallback(writer=writer, every=0)
    canonical = {n: 0.0 for n in PARAMETER_NAMES}
    state = StepState(stage="s", stage_index=0, step=0, stage_step=0, loss=1.0, grad_norm=0.0,
                      params={"cell_a": 50.0, "beam_x": 3.0, "orient_x": 0.0, "scale": 1.0},
                      grads={"cell_a": 0.1}, canonical=canonical)
    cb.on_step(state)
    per_name = [t for t in writer.tags if "/" in t]
    assert set(per_name) == {f"{k}/{n}" for k in ("params", "grads") for n in ("cell_a", "beam_x", "orient_x", "scale")} \
        | {f"params/{n}" for n in MISSET_NAMES}
    for tag in per_name:
        assert tag.split("/", 1)[1] in rp.UNITS
    assert parameter_tag("distance") == "params/distance" and parameter_tag("N", "grads") == "grads/N"
    with pytest.raises(ValueError, match="not a parameter name"):
        parameter_tag("misset")
    with pytest.raises(ValueError, match="unknown tag kind"):
        parameter_tag("distance", "values")
    writer.tags.clear()
    cb.on_step(StepState(stage="s", stage_index=0, step=1, stage_step=1, loss=1.0, grad_norm=0.0,
                         params={"scale": 1.0}, grads={}, canonical=canonical))
    assert not any(t.startswith("params/misset") for t in writer.tags)  # only with the orientation free


def test_overrides_accept_every_simulator_name():
    sim = Simulator(config_from_args(ARGS.split()), compile=False)
    p = sim.parameters_dict(**{n: torch.tensor(float(v)) for n, v in sim.setup.params.items()}, orient_x=0.5)
    assert float(p["orient_x"]) == 0.5 and set(p) == set(SIMULATOR_NAMES)
