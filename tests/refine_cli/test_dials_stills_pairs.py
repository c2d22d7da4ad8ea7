"""Several DIALS ``.expt``/``.refl`` pairs of stills as one set (``--expt 'p*/*.expt' --refl 'p*/*.refl'``,
:mod:`refine.inputs.dials_pairs`), each still on its own and jointly, on test_dials_stills.py's synthetic pair of
stills split into two one-experiment pairs in their own folders; the combined ``refined.expt`` and ``refined.refl``
read back; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from nbtorch.io.dials import experiment_image, read_expt, read_refl, refl_table, write_refl
from refine.modes.stills_file import concatenated
from test_dials_stills import _refused, _summary, many_document, stills  # noqa: F401 - stills: the fixture

NAMES = ("one", "two")


def _pairs(stills: Path) -> list[Path]:
    """data/p0/one.expt, one.refl, a.cbf (experiment s0) and data/p1/two.expt, two.refl, b.cbf (s1): the synthetic
    file split in two, each .refl's ids 0; data/many.expt, many.refl (the file itself, its images beside it)."""
    doc = json.loads((stills / "many.expt").read_text())
    columns, _ = refl_table(stills / "many.refl")
    data = Path.cwd() / "data"
    data.mkdir()
    for name in ("many.expt", "many.refl", "a.cbf", "b.cbf"):
        (data / name).write_bytes((stills / name).read_bytes())
    out = []
    for j, (name, image) in enumerate(zip(NAMES, ("a.cbf", "b.cbf"))):
        folder = data / f"p{j}"
        folder.mkdir()
        (folder / image).write_bytes((stills / image).read_bytes())
        one = copy.deepcopy(doc)
        one["experiment"] = [doc["experiment"][j]]
        (folder / f"{name}.expt").write_text(json.dumps(one))
        keep = columns["id"][1] == j
        rows = {k: (kind, arr[keep]) for k, (kind, arr) in columns.items()}
        rows["id"] = ("int", np.zeros(int(keep.sum()), dtype=np.int32))
        write_refl(folder / f"{name}.refl", rows, {0: doc["experiment"][j]["identifier"]})
        out.append(folder)
    return out


def _predicted(result: dict) -> int:
    return sum(p[0] is not None for p in result["spots"]["predicted_final"])


def test_two_pairs_each_still_on_its_own(refine_cli, stills, tmp_path):
    """Globs paired in order: each still from its own pair (its image beside its .expt, its rows of its .refl);
    refined.expt holds both experiments (identifiers, images), refined.refl each pair's rows with ids renumbered;
    a pair of two plus a pair of one (identifiers not distinct: folders by place) with a missing image skipped."""
    folders = _pairs(stills)
    r = refine_cli("--expt", "data/p*/*.expt", "--refl", "data/p*/*.refl", "--out-dir", "out", "--max-steps", "2",
                   "--no-esds")
    assert r.code == 0, r.err
    assert "2 stills of 2 --expt/--refl pairs" in r.out and "2 of 2 images refined, 0 failed" in r.out
    results = [r.json(f"out/{ident}/result.json") for ident in ("s0", "s1")]
    for result, name in zip(results, NAMES):
        assert result["input"]["expt_index"] == 0 and result["input"]["expt"].endswith(f"{name}.expt")
    assert [Path(row["image"]).name for row in _summary(tmp_path / "out" / "summary.csv")] == ["a.cbf", "b.cbf"]
    after = [read_expt(tmp_path / "out" / "refined.expt", k) for k in range(2)]
    assert after[0].n_experiments() == 2 and [e.identifier for e in after] == ["s0", "s1"]
    assert [experiment_image(e)[0] for e in after] == [str(folders[0] / "a.cbf"), str(folders[1] / "b.cbf")]
    before = [read_expt(folders[k] / f"{NAMES[k]}.expt", 0) for k in range(2)]
    assert all(a.crystal["real_space_a"] != b.crystal["real_space_a"] for a, b in zip(after, before))
    refl = read_refl(tmp_path / "out" / "refined.refl", ("id", "xyzobs.px.value", "xyzcal.px"))
    assert [int((refl["id"] == k).sum()) for k in range(2)] == [_predicted(x) for x in results]
    assert refl_table(tmp_path / "out" / "refined.refl")[1] == {0: "s0", 1: "s1"}
    (folders[0] / "a.cbf").unlink()
    r = refine_cli("--expt", "data/many.expt", "data/p0/one.expt", "--refl", "data/many.refl", "data/p0/one.refl",
                   "--out-dir", "out2", "--skip-missing", "--max-steps", "1", "--no-esds")
    assert r.code == 0, r.err
    assert "2 of 3 images refined, 0 failed, 1 skipped" in r.out
    rows = _summary(tmp_path / "out2" / "summary.csv")
    assert [Path(row["folder"]).name for row in rows[:2]] == ["0", "1"] and rows[2]["status"] == "skipped"
    assert r.json("out2/1/result.json")["input"]["expt"] == "data/many.expt"
    three = [read_expt(tmp_path / "out2" / "refined.expt", k) for k in range(3)]
    assert [e.identifier for e in three] == ["s0", "s1", "s0"]
    assert three[2].crystal["real_space_a"] == before[0].crystal["real_space_a"]  # not refined: as given
    assert set(np.unique(read_refl(tmp_path / "out2" / "refined.refl", ("id",))["id"])) == {0, 1}
    assert refl_table(tmp_path / "out2" / "refined.refl")[1] == {0: "s0", 1: "s1", 2: "s0"}


def test_two_pairs_jointly(refine_cli, stills, tmp_path):
    """--joint over two pairs: one cell, each image its own pair's spots; refined.expt both experiments (the one
    detector written once), refined.refl each still's matched spots with ids renumbered; the per-still table."""
    folders = _pairs(stills)
    r = refine_cli("--expt", "data/p0/one.expt", "data/p1/two.expt", "--refl", "data/p0/one.refl", "data/p1/two.refl",
                   "--joint", "--out-dir", "out", "--max-steps", "2", "--no-esds")
    assert r.code == 0, r.err
    assert "2 stills of 2 --expt/--refl pairs" in r.out and "refined jointly" in r.out
    joint = r.json("out/joint.json")
    counts = [len(read_refl(folders[k] / f"{NAMES[k]}.refl", ("id",))["id"]) for k in range(2)]
    assert [im["spots"]["n"] for im in joint["images"]] == counts
    after = [read_expt(tmp_path / "out" / "refined.expt", k) for k in range(2)]
    assert after[0].n_experiments() == 2 and [e.identifier for e in after] == ["s0", "s1"]
    assert [experiment_image(e)[0] for e in after] == [str(folders[0] / "a.cbf"), str(folders[1] / "b.cbf")]
    doc = json.loads((tmp_path / "out" / "refined.expt").read_text())
    assert len(doc["detector"]) == 1 and len(doc["crystal"]) == 2
    refl = read_refl(tmp_path / "out" / "refined.refl", ("id", "xyzcal.px"))
    assert [int((refl["id"] == k).sum()) for k in range(2)] == [im["spots"]["matched_final"] for im in joint["images"]]
    assert refl_table(tmp_path / "out" / "refined.refl")[1] == {0: "s0", 1: "s1"}
    assert [Path(row["image"]).name for row in _summary(tmp_path / "out" / "summary.csv")] == ["a.cbf", "b.cbf"]


def test_bad_pairs_one_line(refine_cli, stills, tmp_path):
    """Different counts, a glob that matches nothing, a missing file, --image or --expt-index with several pairs,
    --images not one per experiment, crystals of two space groups across the pairs with --joint: each one line,
    exit 2, nothing written."""
    _pairs(stills)
    one, two = ("data/p0/one.expt", "data/p0/one.refl"), ("data/p1/two.expt", "data/p1/two.refl")
    err = _refused(refine_cli, tmp_path, "--expt", one[0], two[0], "--refl", one[1])
    assert "--expt/--refl: 2 .expt files and 1 .refl files; give one .refl per .expt" in err
    err = _refused(refine_cli, tmp_path, "--expt", "nothing/*.expt", "--refl", one[1])
    assert "--expt nothing/*.expt: no file matches the pattern" in err
    err = _refused(refine_cli, tmp_path, "--expt", one[0], "gone.expt", "--refl", one[1], two[1])
    assert "--expt gone.expt: file not found" in err
    for extra in (("--image", "data/a.cbf"), ("--expt-index", "0")):
        err = _refused(refine_cli, tmp_path, "--expt", one[0], two[0], "--refl", one[1], two[1], *extra)
        assert f"{extra[0]}: not with several --expt/--refl pairs" in err
        err = _refused(refine_cli, tmp_path, "--expt", "data/p*/*.expt", "--refl", "data/p*/*.refl", *extra)
        assert f"{extra[0]}: not with several --expt/--refl pairs" in err
    err = _refused(refine_cli, tmp_path, "--expt", one[0], two[0], "--refl", one[1], two[1], "--images", "data/a.cbf")
    assert "--images: 1 images for the 2 experiments of the 2 --expt files" in err
    doc = json.loads((tmp_path / two[0]).read_text())
    doc["crystal"][1]["space_group_hall_symbol"] = " P 1"
    (tmp_path / "data" / "p1" / "p1.expt").write_text(json.dumps(doc))
    err = _refused(refine_cli, tmp_path, "--expt", one[0], "data/p1/p1.expt", "--refl", one[1], two[1], "--joint")
    assert f"--expt {one[0]} experiment 0 (P 4) and --expt data/p1/p1.expt experiment 0 (P 1) are in different " \
           "space groups (1 P 4, 1 P 1)" in err


def test_concatenated_offsets_each_documents_references():
    """Each model list concatenated, each experiment's references offset, identifiers kept; one document itself."""
    a = many_document()
    b = many_document(turns=(50.0,), images=("c.cbf",), identifiers=("t0",))
    doc, firsts = concatenated([copy.deepcopy(a), copy.deepcopy(b)])
    assert firsts == [0, 2] and [e["identifier"] for e in doc["experiment"]] == ["s0", "s1", "t0"]
    last = doc["experiment"][2]
    assert (last["crystal"], last["imageset"], last["beam"]) == (2, 2, len(a["beam"]))
    assert doc["imageset"][2]["images"] == ["c.cbf"] and doc["crystal"][2] == b["crystal"][0]
    assert concatenated([a])[0] is a
