"""Many stills of one DIALS file, each refined on its own (issue #44): ``nbtorch-refine --expt many.expt --refl
many.refl --out-dir DIR`` (:mod:`refine.many.dials_stills`).

The real five CuNiR stills (tests/data/dials, their images not on this machine) are read and refused; a synthetic pair
of stills written as DIALS leaves them (one ``.expt`` of two experiments sharing beam and detector, each with its
crystal and imageset; one ``.refl`` whose ``id`` names the experiment, test_dials_still.py's still) is refined end to
end with two steps; bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import csv
import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import simulate
from nbtorch.dials.geometry import experiment_flags
from nbtorch.io import write_cbf
from nbtorch.io.dials import experiment_image, read_expt, read_refl, write_refl
from nbtorch.io.hdf5 import write_h5
from refine.inputs.spots import find_spots
from refine.many.dials_stills import read_dials_stills
from test_dials_still import CRYSTAL, PIXEL, still_document

DATA = Path(__file__).resolve().parents[1] / "data" / "dials"
TURNS = (0.0, 25.0)  # the two stills' crystals: turned 25 deg apart


def many_document(turns=TURNS, images=("a.cbf", "b.cbf"), identifiers=("s0", "s1")) -> dict:
    """One .expt of len(turns) stills (test_dials_still's, each crystal turned by its angle) sharing beam and
    detector, each with its own crystal and imageset."""
    doc = still_document()
    doc["experiment"], doc["imageset"], doc["crystal"] = [], [], []
    for k, (turn, image, ident) in enumerate(zip(turns, images, identifiers)):
        one = still_document(turn)
        doc["crystal"].append(one["crystal"][0])
        doc["imageset"].append({**copy.deepcopy(one["imageset"][0]), "images": [image]})
        doc["experiment"].append({**one["experiment"][0], "identifier": ident, "crystal": k, "imageset": k})
    return doc


def _refl(path: Path, spots_by_id: list[np.ndarray], ids=None) -> None:
    ids = ids if ids is not None else np.concatenate([np.full(len(s), k) for k, s in enumerate(spots_by_id)])
    xy = np.concatenate(spots_by_id)
    n = len(xy)
    write_refl(path, {"xyzobs.px.value": ("vec3<double>", np.c_[xy[:, :2], np.zeros(n)]),
                      "miller_index": ("cctbx::miller::index<>", np.zeros((n, 3), dtype=np.int32)),
                      "flags": ("std::size_t", np.full(n, (1 << 5) | (1 << 2), dtype=np.uint64)),
                      "id": ("int", np.asarray(ids, dtype=np.int32)),
                      "panel": ("std::size_t", np.zeros(n, dtype=np.uint64))}, {0: "s0", 1: "s1"})


@pytest.fixture(scope="module")
def stills(tmp_path_factory) -> Path:
    """data/many.expt, data/a.cbf and data/b.cbf (each simulated from its experiment), data/many.refl (their spots,
    ids 0 and 1)."""
    folder = tmp_path_factory.mktemp("dials_stills") / "data"
    folder.mkdir()
    doc = many_document()
    (folder / "many.expt").write_text(json.dumps(doc))
    spots = []
    for k, name in enumerate(("a.cbf", "b.cbf")):
        flags = " ".join(experiment_flags(read_expt(folder / "many.expt", k)))
        img = simulate(f"{flags} {CRYSTAL}", scale=0.1, background=2.0)
        write_cbf(folder / name, img, {"pixel_size_mm": PIXEL})
        spots.append(find_spots(img.astype(float)))
    _refl(folder / "many.refl", spots)
    return folder


def _copy_data(stills: Path) -> Path:
    data = Path.cwd() / "data"
    data.mkdir()
    for f in stills.iterdir():
        (data / f.name).write_bytes(f.read_bytes())
    return data


def _summary(path: Path) -> list[dict]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_real_serial_file_read_and_its_missing_images_refused(refine_cli, tmp_path):
    """The CuNiR file: 5 stills, their reflections counted by id, images from the .expt's folder; the images are not
    here: one line naming the first, exit 2, nothing written; --skip-missing lists all five in the summary."""
    expt, refl = DATA / "cunir_ssx_indexed.expt", DATA / "cunir_ssx_indexed.refl"
    stills = read_dials_stills(str(expt), str(refl))
    assert [s.reflections for s in stills] == [34, 36, 194, 34, 62]
    assert [s.index for s in stills] == [0, 1, 2, 3, 4] and stills[1].identifier == "c4fc52a7-327f-4475-93d1-187bb796f907"
    first = DATA.parent / "cunir_serial" / "merlin0047_17000.cbf"
    assert [s.image for s in stills] == [str(first).replace("17000", f"1700{k}") for k in range(5)]
    assert all(s.frame is None for s in stills)
    r = refine_cli("--expt", expt, "--refl", refl, "--out-dir", "out")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert (f"experiment 0 (2c2f20d9-7012-4f15-8065-c7f1dadeacec): image {first} not found (and 4 more of the 5 "
            "experiments)") in r.err
    assert not (tmp_path / "out").exists()
    r = refine_cli("--expt", expt, "--refl", refl, "--out-dir", "out", "--skip-missing")
    assert r.code == 1, r.err  # nothing refined
    rows = _summary(tmp_path / "out" / "summary.csv")
    assert [row["status"] for row in rows] == ["skipped"] * 5
    assert rows[2]["image"].endswith("merlin0047_17002.cbf") and rows[2]["reason"] == "experiment 2: image not found"
    assert "0 of 5 images refined, 0 failed, 5 skipped" in r.out


def test_two_stills_refined_each_on_its_own(refine_cli, stills, tmp_path):
    """Each experiment with its image (relative to the .expt), crystal and reflections: results in out/<identifier>/,
    the summary and out/refined.expt (both experiments, each crystal refined; a skipped one as given); an image missing with --skip-missing: the other refined, the missing one listed; --images gives
    moved images in experiment order."""
    data = _copy_data(stills)
    counts = [s.reflections for s in read_dials_stills(str(data / "many.expt"), str(data / "many.refl"))]
    r = refine_cli("--expt", "data/many.expt", "--refl", "data/many.refl", "--out-dir", "out", "--max-steps", "2",
                   "--no-esds")
    assert r.code == 0, r.err
    assert "2 stills of --expt data/many.expt" in r.out and "2 of 2 images refined, 0 failed" in r.out
    for k, ident in enumerate(("s0", "s1")):
        result = r.json(f"out/{ident}/result.json")
        assert result["spots"]["n"] == counts[k] and result["status"] in ("converged", "max_steps")
        assert "orient_x" in result["free"] and "cell_a" in result["free"]  # the still defaults
        assert result["input"]["expt_index"] == k and result["input"]["expt"].endswith("many.expt")
        # refined.refl: the still's matched spots with its result's final predictions, in the .refl's order
        refl = read_refl(tmp_path / "out" / "refined.refl", ("xyzobs.px.value", "xyzcal.px"), experiment_id=k)
        spots = result["spots"]
        want = [(o[0], o[1], p[0], p[1]) for o, p in zip(spots["observed"], spots["predicted_final"]) if p[0] is not None]
        assert np.allclose(np.c_[refl["xyzobs.px.value"][:, :2], refl["xyzcal.px"][:, :2]], want)
    rows = _summary(tmp_path / "out" / "summary.csv")
    assert [Path(row["image"]).name for row in rows] == ["a.cbf", "b.cbf"]
    for row, ident in zip(rows, ("s0", "s1")):  # each still's cell, orientation and scale from its result
        params = r.json(f"out/{ident}/result.json")["params"]
        assert [float(row[k]) for k in ("cell_a", "misset_y", "scale")] == pytest.approx(
            [params[k] for k in ("cell_a", "misset_y", "scale")], rel=1e-9)
    assert [Path(row["folder"]).name for row in rows] == ["s0", "s1"]
    # summary.html: each cell length refined per still, so its histogram (the tetragonal angles are fixed: none)
    page = (tmp_path / "out" / "summary.html").read_text()
    assert re.findall(r'<img alt="histogram of (\w+)" src="data:image/png;base64,', page) == [
        "cell_a", "cell_b", "cell_c", "spot_rms"]
    assert "2 of 2 stills refined, 0 failed, 0 skipped" in page and page.count("<tr>") == 3
    before = [read_expt(data / "many.expt", k) for k in range(2)]
    after = [read_expt(tmp_path / "out" / "refined.expt", k) for k in range(2)]  # both experiments, each refined
    assert after[0].n_experiments() == 2 and [e.identifier for e in after] == ["s0", "s1"]
    assert [experiment_image(e) for e in after] == [experiment_image(e) for e in before]
    assert all(a.crystal["real_space_a"] != b.crystal["real_space_a"] for a, b in zip(after, before))
    assert "refined experiments (2 of 2 refined, the others as given)" in r.out
    moved = tmp_path / "moved"
    moved.mkdir()
    (data / "b.cbf").rename(moved / "b.cbf")
    r = refine_cli("--expt", "data/many.expt", "--refl", "data/many.refl", "--out-dir", "out2", "--skip-missing",
                   "--max-steps", "1", "--no-esds")
    assert r.code == 0, r.err
    assert "1 of 2 images refined, 0 failed, 1 skipped" in r.out and "experiment 1: image not found" in r.out
    assert [row["status"] for row in _summary(tmp_path / "out2" / "summary.csv")][1] == "skipped"
    kept = read_expt(tmp_path / "out2" / "refined.expt", 1)  # the skipped still: its input crystal
    assert kept.crystal["real_space_a"] == before[1].crystal["real_space_a"]
    assert kept.n_experiments() == 2 and experiment_image(kept) == experiment_image(before[1])
    r = refine_cli("--expt", "data/many.expt", "--refl", "data/many.refl", "--images", "data/a.cbf", "moved/b.cbf",
                   "--out-dir", "out3", "--max-steps", "1", "--no-esds")
    assert r.code == 0, r.err
    assert r.json("out3/s1/result.json")["spots"]["n"] == counts[1]
    assert experiment_image(read_expt(tmp_path / "out3" / "refined.expt", 1))[0] == str(moved / "b.cbf")


def _refused(refine_cli, tmp_path, *argv) -> str:
    r = refine_cli(*argv, "--out-dir", "out")
    assert r.code == 2 and r.err.count("\n") == 1, (r.code, r.out, r.err)
    assert not (tmp_path / "out").exists()
    return r.err


def test_bad_serial_input_one_line(refine_cli, tmp_path):
    """No crystal, a reflection id naming no experiment, a frame past the end of its HDF5 file, an imageset of several
    images, --images not one per experiment: each one line, exit 2, nothing written."""
    img = np.full((96, 96), 2, dtype=np.int32)
    write_cbf(tmp_path / "a.cbf", img, {"pixel_size_mm": PIXEL})
    write_cbf(tmp_path / "b.cbf", img, {"pixel_size_mm": PIXEL})
    _refl(tmp_path / "ok.refl", [np.full((3, 2), 10.0), np.full((3, 2), 20.0)])
    doc = many_document()
    doc["experiment"][1].pop("crystal")
    (tmp_path / "nocrystal.expt").write_text(json.dumps(doc))
    err = _refused(refine_cli, tmp_path, "--expt", "nocrystal.expt", "--refl", "ok.refl")
    assert "--expt nocrystal.expt: experiment 1 (s1) has no crystal (not indexed)" in err
    (tmp_path / "many.expt").write_text(json.dumps(many_document()))
    _refl(tmp_path / "bad.refl", [np.full((3, 2), 10.0), np.full((3, 2), 20.0)], ids=[0, 0, 1, 1, 2, -1])
    err = _refused(refine_cli, tmp_path, "--expt", "many.expt", "--refl", "bad.refl")
    assert "--refl bad.refl: reflection id 2 names no experiment of --expt many.expt (it has 2: ids 0..1; 1 such rows)" \
        in err
    write_h5(tmp_path / "run.h5", np.stack([img, img]).astype(np.float32), geometry={"pixel_size_mm": PIXEL})
    doc = many_document(images=("run.h5", "run.h5"))
    for k, frame in enumerate((1, 2)):
        doc["imageset"][k]["single_file_indices"] = [frame]
    (tmp_path / "h5.expt").write_text(json.dumps(doc))
    err = _refused(refine_cli, tmp_path, "--expt", "h5.expt", "--refl", "ok.refl")
    assert f"--expt h5.expt: experiment 1: frame 2 of {tmp_path / 'run.h5'} does not exist (its /entry/data/data " \
           "holds 2 frames)" in err
    stills = read_dials_stills(str(tmp_path / "h5.expt"), str(tmp_path / "ok.refl"))
    assert [(Path(s.image).name, s.frame) for s in stills] == [("run.h5", 1), ("run.h5", 2)]
    doc = many_document()
    doc["imageset"][0]["images"] = ["a.cbf", "b.cbf"]
    (tmp_path / "set.expt").write_text(json.dumps(doc))
    err = _refused(refine_cli, tmp_path, "--expt", "set.expt", "--refl", "ok.refl")
    assert "--expt set.expt: experiment 0: its imageset names 2 images; one image per still experiment is read" in err
    err = _refused(refine_cli, tmp_path, "--expt", "many.expt", "--refl", "ok.refl", "--images", "a.cbf")
    assert "--images: 1 images for the 2 experiments of --expt many.expt" in err


def test_dtpb_file_frames_of_one_nexus_master(refine_cli, tmp_path):
    """The DtpB file (dials/data-files, 16 stills, each a frame of one NeXus master named by ``single_file_indices``;
    its .refl is not in the mirror, so the reflections are written here, experiment k given k + 1 rows and one
    unindexed row): counted by id; the master is not here: one line naming it, exit 2, nothing written, and
    --skip-missing lists all 16; with a master of 2 frames in its place, frame 11000 is past its end: one line."""
    expt = DATA / "dtpb_ssx_well39_integrated.expt"
    ids = np.r_[np.repeat(np.arange(16), np.arange(1, 17)), -1]
    _refl(tmp_path / "dtpb.refl", [np.full((len(ids), 2), 10.0)], ids=ids)
    stills = read_dials_stills(str(expt), str(tmp_path / "dtpb.refl"))
    assert [s.reflections for s in stills] == list(range(1, 17))
    master = "/dls/mx/data/nt30330/nt30330-15/VMXi-AB1698/well_39/images/image_58763.nxs"
    assert {s.image for s in stills} == {master}
    assert [s.frame for s in stills][:4] == [11000, 11083, 11100, 11101] and stills[-1].frame == 11799
    assert stills[0].identifier == "04e940a5-9acc-d01c-b8af-513311866860"
    err = _refused(refine_cli, tmp_path, "--expt", expt, "--refl", "dtpb.refl")
    assert f"experiment 0 (04e940a5-9acc-d01c-b8af-513311866860): image {master} not found (and 15 more of the 16 " \
           "experiments)" in err
    doc = json.loads(expt.read_text())
    img = np.full((96, 96), 2, dtype=np.int32)
    write_h5(tmp_path / "image_58763.nxs", np.stack([img, img]).astype(np.float32), geometry={"pixel_size_mm": PIXEL})
    for iset in doc["imageset"]:
        iset["images"] = ["image_58763.nxs"]
    (tmp_path / "here.expt").write_text(json.dumps(doc))
    err = _refused(refine_cli, tmp_path, "--expt", "here.expt", "--refl", "dtpb.refl")
    assert f"--expt here.expt: experiment 0: frame 11000 of {tmp_path / 'image_58763.nxs'} does not exist (its " \
           "/entry/data/data holds 2 frames)" in err
    r = refine_cli("--expt", expt, "--refl", "dtpb.refl", "--out-dir", "out", "--skip-missing")
    assert r.code == 1 and "0 of 16 images refined, 0 failed, 16 skipped" in r.out, r.err
    rows = _summary(tmp_path / "out" / "summary.csv")
    assert [row["image"] for row in rows] == [f"{master} frame {s.frame}" for s in stills]
    assert {row["status"] for row in rows} == {"skipped"} and rows[15]["reason"] == "experiment 15: image not found"
