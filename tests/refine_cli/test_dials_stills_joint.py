"""The stills of one DIALS file refined jointly (``--expt many.expt --refl many.refl --joint``) and the refined
``OUT_DIR/refined.expt`` of every experiment (issue #44; :mod:`refine.modes.stills_file`), on test_dials_stills.py's
synthetic pair of stills, two steps."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from nbtorch.io.dials import experiment_image, read_expt
from refine.modes.stills_file import combined_document
from refine.many.dials_stills import read_dials_stills
from test_dials_stills import _copy_data, _refused, many_document, stills  # noqa: F401 - stills: the fixture


def _read_back(path, n: int) -> list:
    exps = [read_expt(path, k, multi_panel=True) for k in range(n)]
    assert exps[0].n_experiments() == n
    return exps


def test_joint_stills_from_the_file_alone(refine_cli, stills, tmp_path):
    """Image i is experiment i's (relative to the .expt), its spots the rows of id i; one shared cell; refined.expt
    holds both experiments (identifiers and images kept, each crystal refined, the held detector written once)."""
    data = _copy_data(stills)
    counts = [s.reflections for s in read_dials_stills(str(data / "many.expt"), str(data / "many.refl"))]
    r = refine_cli("--expt", "data/many.expt", "--refl", "data/many.refl", "--joint", "--out-dir", "out",
                   "--max-steps", "2", "--no-esds")
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
