"""Refinement of panel geometry by groups (refine.fitting.panel_groups): rigid bodies per hierarchy level.

Synthetic: the 8-panel hierarchical detector of tests/multi_panel_data.py (a real CuNiR still's Pilatus 6M cut
into two columns of four panels), the two column groups moved by known shifts; the fit, from the unmoved start,
recovers every spot position to 0.1 px.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from multi_panel_data import COLS, ROWS, offset, split_document, write_doc
from nbtorch.dials.geometry import bragg_positions_px
from nbtorch.dials.panels import hierarchy_groups, panels_simulator
from nbtorch.errors import InputError
from nbtorch.io.dials import read_expt, read_refl
from nbtorch.geometry.panels import group_overrides
from refine.fitting.panel_groups import fit_panel_groups, identifiable_groups, spots_per_group
from refine.inputs.spots import window_mask

TRUTH = {"beam_x_g0": 0.10, "beam_y_g0": -0.08, "distance_g0": 0.06,
         "beam_x_g1": -0.09, "beam_y_g1": 0.11, "distance_g1": -0.05}  # mm: about half a 0.172 mm pixel


def _experiment(tmp_path: Path):
    exp = read_expt(write_doc(tmp_path, split_document()), multi_panel=True)
    sim = panels_simulator(exp, extra_flags=["-N", "20", "-default_F", "100", "-oversample", "1"],
                           dtype=torch.float64)
    r = read_refl(Path(__file__).resolve().parent / "data" / "dials" / "cunir_ssx_indexed.refl",
                  ("miller_index", "xyzcal.px", "xyzcal.mm", "delpsical.rad"), experiment_id=0)
    keep = np.any(r["xyzcal.mm"] != 0, axis=1)
    r = {k: v[keep] for k, v in r.items()}
    spots, rows = [], []
    for j, (x, y) in enumerate(r["xyzcal.px"][:, :2]):
        a, b = min(int(x // COLS[0]), 1), min(int(y // ROWS[0]), 3)
        x0, y0 = offset(4 * a + b)
        if 6 <= x - x0 <= COLS[a] - 6 and 6 <= y - y0 <= ROWS[b] - 6:
            spots.append((x - x0, y - y0 + (4 * a + b) * sim.panel_layout.rows))
            rows.append(j)
    return exp, sim, np.array(spots), {k: v[rows] for k, v in r.items()}


def _positions(sim, values: dict, r: dict) -> np.ndarray:
    """(n, 8, 2): every reflection's position in every panel's pixels at per-panel ``values``."""
    return np.stack([bragg_positions_px(sim, values, r["miller_index"], 0.0, r["delpsical.rad"], panel=i)
                     for i in range(8)], axis=1)


def test_groups_refined_from_a_perturbed_start_return_within_a_tenth_of_a_pixel(tmp_path: Path) -> None:
    exp, sim, spots, r = _experiment(tmp_path)
    groups = [members for _, members in hierarchy_groups(exp.detector)[1]]  # the two columns
    assert groups == [(0, 1, 2, 3), (4, 5, 6, 7)]
    start = {n: v.detach() for n, v in sim.parameters_dict().items() if "_p" in n}
    truth = {k: float(v) for k, v in group_overrides(sim.panel_layout, groups, start,
                                                     {k: torch.tensor(v, dtype=torch.float64)
                                                      for k, v in TRUTH.items()}).items()}
    mask = window_mask(sim.shape, spots, 3)
    observed, _ = sim.restricted(mask).render(**truth)
    fit = fit_panel_groups(sim, observed.numpy(), mask, groups, spots=spots, labels=["col0", "col1"])
    assert fit.fixed == ()
    assert fit.loss_end < 1e-6 * fit.loss_start
    want, got, before = _positions(sim, truth, r), _positions(sim, fit.overrides(sim), r), _positions(sim, {}, r)
    assert np.abs(before - want).max() > 0.3  # the start is off by about half a pixel or more
    assert np.abs(got - want).max() < 0.1, np.abs(got - want).max()
    for key, value in TRUTH.items():
        assert fit.changes[key] == pytest.approx(value, abs=0.1 * 0.172)


def test_a_group_needs_enough_spots(tmp_path: Path) -> None:
    exp, sim, spots, _ = _experiment(tmp_path)
    panels = [members for _, members in hierarchy_groups(exp.detector)[-1]]
    counts = spots_per_group(sim.panel_layout, panels, spots)
    assert sum(counts) == len(spots) and len(counts) == 8
    free, fixed = identifiable_groups(panels, counts, 3, min_spots_per_name=2)
    assert len(free) + len(fixed) == 8
    few = [k for k, n in enumerate(counts) if n < 6]
    assert few and [k for k in range(8) if k not in free] == few
    assert f"{counts[few[0]]} spots for 3 names (needs 6)" in fixed[0]
    mask = window_mask(sim.shape, spots, 3)
    fit = fit_panel_groups(sim, np.zeros(sim.shape), mask, panels, spots=spots, max_evaluations=1)
    assert len(fit.fixed) == len(few)
    assert not any(key.endswith(f"_g{k}") for key in fit.changes for k in few)


def test_groups_must_be_rigid_and_names_known(tmp_path: Path) -> None:
    exp, sim, spots, _ = _experiment(tmp_path)
    mask = window_mask(sim.shape, spots, 3)
    with pytest.raises(InputError, match="cell_a is not a panel geometry name"):
        fit_panel_groups(sim, np.zeros(sim.shape), mask, [(0, 1)], names=("cell_a",))
    with pytest.raises(InputError, match="observed image and pixel mask must be"):
        fit_panel_groups(sim, np.zeros((3, 3)), mask, [(0, 1)])
    tilted = panels_simulator(read_expt(write_doc(tmp_path, _tilt(split_document(), 5), "tilt.expt"),
                                        multi_panel=True), extra_flags=["-N", "5"])
    with pytest.raises(InputError, match="panel group 0: panel 5 .* does not share the axes"):
        fit_panel_groups(tilted, np.zeros(tilted.shape), np.zeros(tilted.shape, dtype=bool), [(0, 5)])


def _tilt(doc: dict, panel: int) -> dict:
    p = doc["detector"][0]["panels"][panel]
    c, s = np.cos(0.01), np.sin(0.01)
    p["fast_axis"], p["slow_axis"] = [c, s, 0.0], [-s, c, 0.0]
    return doc


def test_multi_panel_groups_need_rigidity_only_where_their_geometry_is_refined(tmp_path: Path) -> None:
    """A detector whose panels are not all parallel (a CSPAD's quadrants) plans a crystal refinement with the
    panels held; refining the geometry of a group that is not a rigid body is refused in one line, before any
    step (the plan is what ``refine`` and ``nbtorch-refine`` build first)."""
    from refine.solver.plan import make_plan
    from refine.solver.stages import single_stage

    tilted = panels_simulator(read_expt(write_doc(tmp_path, _tilt(split_document(), 5), "tilt.expt"),
                                        multi_panel=True), extra_flags=["-N", "20", "-default_F", "100"])
    observed = np.ones(tilted.shape)
    plan = make_plan(tilted, observed, stages=single_stage(("scale", "background", "orientation", "cell")))
    assert "distance_g0" not in plan.names and "orient_x" in plan.names
    with pytest.raises(InputError, match=r"panel group 0: panel 5 .* does not share the axes") as info:
        make_plan(tilted, observed, stages=single_stage(("scale", "panels")))
    assert "\n" not in str(info.value)
