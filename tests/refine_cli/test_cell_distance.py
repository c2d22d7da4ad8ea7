"""A cell refined on one measured image with the distance held says so: the cell rests on the distance, and what the
still measures is cell / distance (refine.quality.cell_distance)."""

from __future__ import annotations

import pytest

from cli_helpers import SMALL_MODEL, simulate
from nbtorch.io import write_cbf
from refine.quality.cell_distance import cell_distance_note, note_line

PARAMS = {"cell_a": 57.6, "cell_b": 57.6, "cell_c": 150.0, "distance": 350.0}


def test_note_only_when_cell_is_refined_and_the_distance_held():
    note = cell_distance_note(PARAMS, ("scale", "cell_a", "cell_c"))
    assert note["distance_mm"] == 350.0 and note["distance_refined"] is False
    assert note["cell_per_distance"]["cell_a"] == pytest.approx(57.6 / 350.0)
    assert note["cell_per_distance"]["cell_c"] == pytest.approx(150.0 / 350.0)
    line = note_line(note)
    assert "rests on the distance 350 mm" in line and "a/D 0.164571" in line and "c/D 0.428571" in line
    assert "b/D" not in line
    assert cell_distance_note(PARAMS, ("scale", "cell_a", "cell_c", "distance")) is None
    assert cell_distance_note(PARAMS, ("scale", "background")) is None


def test_multi_panel_group_distance_counts_as_the_distance_refined():
    """``--refine panels --panel-groups LEVEL`` refines ``distance_g<k>``: no note then; beam shifts alone do not."""
    assert cell_distance_note(PARAMS, ("cell_a", "cell_c", "distance_g0", "beam_x_g0")) is None
    assert cell_distance_note(PARAMS, ("cell_a", "cell_c", "distance_g17")) is None
    assert cell_distance_note(PARAMS, ("cell_a", "cell_c", "beam_x_g0", "beam_y_g0")) is not None
    assert cell_distance_note(PARAMS, ("cell_a", "cell_c", "distance_gap")) is not None


def test_cli_warns_and_records_then_not_with_the_distance_refined(refine_cli, tmp_path):
    write_cbf(tmp_path / "obs.cbf", simulate(SMALL_MODEL, background=5.0, seed=4), {"pixel_size_mm": 0.1})
    common = ("--image", "obs.cbf", "--model", SMALL_MODEL, "--symmetry", "tetragonal", "--max-steps", "15")
    r = refine_cli(*common, "--refine", "scale,background,cell")
    assert r.code == 0, r.err
    assert "warning: the cell rests on the distance 40 mm, which was held fixed" in r.out
    note = r.json()["cell_distance"]
    assert note["distance_mm"] == pytest.approx(40.0) and note["cell_per_distance"]["cell_a"] > 0
    r = refine_cli(*common, "--refine", "scale,background,cell,distance")
    assert r.code == 0, r.err
    assert "rests on the distance" not in r.out and "cell_distance" not in r.json()
    r = refine_cli("--problem", "tetragonal_mosflm", "--size", "16", "--refine", "scale,cell", "--max-steps", "3")
    assert r.code == 0, r.err
    assert "rests on the distance" not in r.out  # a synthetic problem: its distance is the truth
