"""The stills of one DIALS file refined jointly (``--expt many.expt --refl many.refl --joint``) and the refined
``OUT_DIR/refined.expt`` of every experiment (issue #44; :mod:`refine.modes.stills_file`), on test_dials_stills.py's
synthetic pair of stills, two steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.dials import experiment_image, read_expt, read_refl
from refine.modes.stills_file import combined_document
from refine.many.batch import SUMMARY_COLUMNS
from refine.many.dials_stills import read_dials_stills
from test_dials_stills import _copy_data, _refl, _refused, _summary, many_document, stills  # noqa: F401 - stills: the fixture


def _read_back(path, n: int) -> list:
    exps = [read_expt(path, k, multi_panel=True) for k in range(n)]
    assert exps[0].n_experiments() == n
    return exps


def test_joint_stills_from_the_file_alone(refine_cli, stills, tmp_path, monkeypatch):
    """Image i is experiment i's (relative to the .expt), its spots the rows of id i; one shared cell; refined.expt
    holds both experiments (identifiers and images kept, each crystal refined, the held detector written once);
    refined.refl takes the final model spots the spot report rendered (no second render)."""
    import refine.inputs.spots

    def no_second_render(*args, **kwargs):
        raise AssertionError("refined.refl rendered the spots again")
    monkeypatch.setattr(refine.inputs.spots, "spot_offsets", no_second_render)  # what write_joint_refl would call
    data = _copy_data(stills)
    counts = [s.reflections for s in read_dials_stills(str(data / "many.expt"), str(data / "many.refl"))]
    r = refine_cli("--expt", "data/many.expt", "--refl", "data/many.refl", "--joint", "--out-dir", "out",
                   "--max-steps", "2", "--no-esds", "--report", "report.html")
    assert r.code == 0, r.err
    assert "2 stills of --expt data/many.expt" in r.out and "refined jointly" in r.out
    # each still fitted as one still from DIALS files is: windows about its spots and a sample of the rest, not the
    # whole image (the refined names are the joint run's --shared and --per-image, not one still's)
    assert "a still from DIALS files" in r.out and "spot windows of +-" in r.out, r.out
    assert "refine scale,background,orientation,cell,mosaic" not in r.out
    fitted = [tuple(map(int, m)) for m in re.findall(r"fitting (\d+) of (\d+) pixels", r.out)]
    assert len(fitted) == 2 and all(n < total / 2 for n, total in fitted), fitted
    joint = r.json("out/joint.json")
    assert [im["spots"]["n"] for im in joint["images"]] == counts  # each image its own rows of the .refl
    starts = [im["initial_params"] for im in joint["images"]]
    assert abs(starts[0]["misset_x"] - starts[1]["misset_x"]) > 1  # each from its own experiment's crystal
    # one detector for the stills: the distance shared with the cell (a held distance's error would be the cell's)
    assert "  shared: cell and distance (one detector for every still" in r.out
    assert "cell_a" in joint["shared_names"] and "distance" in joint["shared_names"]
    before = _read_back(data / "many.expt", 2)
    after = _read_back(tmp_path / "out" / "refined.expt", 2)
    assert [e.identifier for e in after] == ["s0", "s1"]
    assert [experiment_image(e) for e in after] == [experiment_image(e) for e in before]
    assert not np.allclose(after[1].crystal["real_space_a"], before[1].crystal["real_space_a"])
    doc = json.loads((tmp_path / "out" / "refined.expt").read_text())
    assert len(doc["detector"]) == 1 and len(doc["crystal"]) == 2
    assert "refined experiments:" in r.out
    # refined.refl: each still's observed spots with the joint model's predictions, DIALS's own prediction left out
    refl = read_refl(tmp_path / "out" / "refined.refl", ("id", "xyzobs.px.value", "xyzcal.px", "miller_index"))
    ids = refl["id"]
    assert set(np.unique(ids)) == {0, 1} and "refined predictions:" in r.out
    for k in (0, 1):
        off = refl["xyzcal.px"][ids == k, :2] - refl["xyzobs.px.value"][ids == k, :2]
        n = joint["images"][k]["spots"]
        assert len(off) == n["matched_final"]
        assert np.sqrt((off ** 2).sum(1).mean()) == pytest.approx(n["rms_px_final"], rel=1e-6)
    with pytest.raises(InputError, match="xyzcal.mm"):
        read_refl(tmp_path / "out" / "refined.refl", ("xyzcal.mm",))
    # the per-still table, as independent mode writes it: each image's values from joint.json
    rows = _summary(tmp_path / "out" / "summary.csv")
    assert list(rows[0]) == list(SUMMARY_COLUMNS) and [Path(row["image"]).name for row in rows] == ["a.cbf", "b.cbf"]
    for row, im in zip(rows, joint["images"]):
        assert row["status"] == joint["status"] and float(row["steps"]) == joint["steps"]
        for key in ("cell_a", "cell_gamma", "misset_x", "misset_z", "scale", "distance"):
            assert float(row[key]) == pytest.approx(im["params"][key], rel=1e-9), key
        assert float(row["fit_excess"]) == pytest.approx(im["fit"]["excess"], rel=1e-9)
        assert float(row["spot_rms_px_final"]) == pytest.approx(im["spots"]["rms_px_final_common"], rel=1e-9)
        assert int(float(row["spots"])) == im["spots"]["n"]
    assert float(rows[0]["misset_x"]) != float(rows[1]["misset_x"]) and rows[0]["cell_a"] == rows[1]["cell_a"]
    with h5py.File(tmp_path / "out" / "summary.h5") as h5:
        assert h5["scale"][()] == pytest.approx([im["params"]["scale"] for im in joint["images"]], rel=1e-9)
        assert [s.decode() for s in h5["status"][()]] == [joint["status"]] * 2
    assert "per-still table:" in r.out
    # the page: the stills' spot rms as a histogram; the cell is shared (one value), so no histogram of it
    page = (tmp_path / "report.html").read_text()
    assert re.findall(r'<img alt="histogram of (\w+)" src="data:image/png;base64,', page) == ["spot_rms"]
    assert "<h2>Distributions over the images</h2>" in page


def test_joint_stills_missing_image_refused(refine_cli, stills, tmp_path):
    """A missing image: one line naming it, exit 2, nothing written (before any work)."""
    data = _copy_data(stills)
    (data / "b.cbf").unlink()
    err = _refused(refine_cli, tmp_path, "--expt", "data/many.expt", "--refl", "data/many.refl", "--joint")
    assert "--expt data/many.expt: experiment 1 (s1): image" in err and "b.cbf not found" in err


@pytest.mark.parametrize("mode", [[], ["--joint"]])
def test_expt_out_is_refused_for_the_stills_of_one_file(refine_cli, stills, tmp_path, mode):
    """Every experiment goes to OUT_DIR/refined.expt; an --expt-out would hold one still (or be overwritten)."""
    _copy_data(stills)
    err = _refused(refine_cli, tmp_path, "--expt", "data/many.expt", "--refl", "data/many.refl", *mode,
                   "--expt-out", "mine.expt")
    assert "--expt-out mine.expt: the stills of one DIALS file are written together" in err
    assert not (tmp_path / "mine.expt").exists()


def test_combined_document_keeps_unrefined_and_merges_equal_models():
    """An experiment without a part keeps its models; equal models are written once, unused ones dropped."""
    doc = many_document(turns=(0.0, 25.0, 50.0), images=("a.cbf", "b.cbf", "c.cbf"), identifiers=("s0", "s1", "s2"))
    part = {"beam": doc["beam"][0], "detector": doc["detector"][0], "crystal": {**doc["crystal"][1], "real_space_a": [1.0, 2.0, 3.0]}}
    out = combined_document(doc, {1: part})
    assert [e["identifier"] for e in out["experiment"]] == ["s0", "s1", "s2"]
    assert len(out["beam"]) == 1 and len(out["detector"]) == 1 and len(out["crystal"]) == 3
    assert out["crystal"][out["experiment"][1]["crystal"]]["real_space_a"] == [1.0, 2.0, 3.0]
    assert out["crystal"][out["experiment"][2]["crystal"]] == doc["crystal"][2]
    assert doc["crystal"][1]["real_space_a"] != [1.0, 2.0, 3.0]  # the input left alone


def test_joint_stills_of_mixed_space_groups_refused(refine_cli, tmp_path):
    """Crystals of two space groups in one joint run: one line naming both experiments, exit 2, nothing written
    (before any image is read); each on its own (no --joint) is not refused for it."""
    doc = many_document(turns=(0.0, 25.0, 50.0), images=("a.cbf", "b.cbf", "c.cbf"), identifiers=("s0", "s1", "s2"))
    doc["crystal"][2]["space_group_hall_symbol"] = " P 1"
    (tmp_path / "mixed.expt").write_text(json.dumps(doc))
    _refl(tmp_path / "mixed.refl", [np.full((2, 2), 10.0)] * 3)
    err = _refused(refine_cli, tmp_path, "--expt", "mixed.expt", "--refl", "mixed.refl", "--joint")
    assert "--expt mixed.expt: experiments 0 (P 4) and 2 (P 1) are in different space groups (2 P 4, 1 P 1); a joint " \
           "run refines one cell" in err
    assert [s.space_group for s in read_dials_stills(str(tmp_path / "mixed.expt"), str(tmp_path / "mixed.refl"))] \
        == ["P 4", "P 4", "P 1"]
    err = _refused(refine_cli, tmp_path, "--expt", "mixed.expt", "--refl", "mixed.refl")  # independent: the images
    assert "space groups" not in err and "a.cbf not found" in err


def test_joint_rows_give_each_image_its_values_and_list_the_skipped():
    """A joint result's per-image values as summary rows; a run that did not end well gives every row its message;
    the skipped stills follow with their reasons."""
    from types import SimpleNamespace

    from refine.many.batch import joint_summary_rows
    from refine.solver.loop import Status

    result = SimpleNamespace(
        status=Status.DIVERGED, message="loss rose", steps=7, wall_s=3.5, image_losses=(10.0, 20.0),
        images=({"cell_a": 50.0, "misset_x": 1.0, "scale": 2.0}, {"cell_a": 50.0, "misset_x": -4.0, "scale": 3.0}),
        image_fit=({"excess": 1.5}, {"excess": 2.5}),
        image_spots=({"n": 5, "matched_final": 4, "rms_px_start_common": 1.2, "rms_px_final_common": 0.4}, {}))
    rows = joint_summary_rows(result, ["a.cbf", "b.h5 frame 3"], [("c.cbf", "experiment 2: image not found")])
    assert [r["image"] for r in rows] == ["a.cbf", "b.h5 frame 3", "c.cbf"]
    assert [r["status"] for r in rows] == [Status.DIVERGED.value] * 2 + ["skipped"]
    assert [r["reason"] for r in rows] == ["loss rose", "loss rose", "experiment 2: image not found"]
    assert [r["misset_x"] for r in rows[:2]] == [1.0, -4.0] and [r["scale"] for r in rows[:2]] == [2.0, 3.0]
    assert rows[0]["spot_rms_px_final"] == 0.4 and rows[0]["spots_matched"] == 4.0 and rows[1]["fit_excess"] == 2.5
    assert np.isnan(rows[1]["spot_rms_px_final"]) and np.isnan(rows[0]["cell_b"]) and rows[1]["loss_final"] == 20.0
    assert all(np.isnan(rows[2][k]) for k in ("cell_a", "scale", "steps"))


def test_the_front_door_refines_the_files_stills_jointly_and_each_alone(stills, tmp_path, monkeypatch):
    """From Python (:mod:`refine.modes.entry`): the stills of the file together (a JointResult, refined.expt of both)
    and each on its own (the batch's exit status and summary), their lines to ``say``."""
    from refine import Measurement, Settings, refine_each, refine_stills_jointly
    from refine.output.results import JointResult

    monkeypatch.chdir(tmp_path)
    m = Measurement.from_dials(stills / "many.expt", stills / "many.refl")
    lines: list[str] = []
    result = refine_stills_jointly(m, Settings.of(out_dir="joint", max_steps=1, no_esds=True), say=lines.append)
    assert isinstance(result, JointResult) and len(result.images) == 2
    assert any("2 stills of --expt" in line and "refined jointly" in line for line in lines), lines
    assert (tmp_path / "joint" / "refined.expt").is_file()
    lines.clear()
    assert refine_each(m, Settings.of(out_dir="each", max_steps=1, no_esds=True), say=lines.append) == 0
    assert any("each refined on its own" in line for line in lines) and (tmp_path / "each" / "summary.csv").is_file()
