"""nbtorch-refine --images ... --joint --screen / --add-to (refine.cli.serial): a serial set of stills written as
CBF files, refined in rounds with the images that do not fit dropped and listed; more images added to the
finished run; the options' checks."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from experiments.serial_data import make_serial
from nbtorch.io.cbf import write_cbf

FLAG_OF = {"misset": ("misset_x", "misset_y", "misset_z"), "mosaic": ("mosaic_spread",)}


def _model(args: tuple, start: dict) -> str:
    """The set's nanoBragg flags with this image's starting misset and mosaic spread."""
    out, i = [], 0
    while i < len(args):
        flag = args[i].lstrip("-")
        if flag in FLAG_OF:
            names = FLAG_OF[flag]
            out += [args[i], *(repr(float(start[n])) for n in names)]
            i += 1 + len(names)
        else:
            out.append(args[i])
            i += 1
    return " ".join(out)


SIZE = 32


@pytest.fixture(scope="module")
def serial_set():
    """10 stills of SIZE x SIZE px: images 0-7 with two bad ones (another crystal form: its spots miss the start,
    no lattice: blobs and a streak), 8-9 good."""
    ds = make_serial(12, np.random.default_rng(5), size=SIZE, bad_fraction=0.17)
    bad = [i for i, im in enumerate(ds.images) if im.kind in ("wrong_crystal", "garbage")]
    good = [i for i, im in enumerate(ds.images) if im.kind == "good"]
    assert len(bad) == 2 and len(good) == 10
    order = good[:3] + bad[:1] + good[3:5] + bad[1:] + good[5:8]
    return ds.subset(order)


def _write(ds, directory) -> tuple[list[str], str]:
    """Each still as ``run7_NN.cbf`` with its model ``run7_NN.txt`` (its indexed orientation and mosaic spread);
    the ``--start`` of the known geometry and the shared cell."""
    names = []
    for im in ds.images:
        write_cbf(directory / f"run7_{im.index:02d}.cbf", np.rint(im.observed).astype(np.int32), {"pixel_size_mm": 0.1})
        (directory / f"run7_{im.index:02d}.txt").write_text(_model(ds.args, im.start))
        names.append(f"run7_{im.index:02d}.cbf")
    start = ds.images[0].start
    known = {k: start[k] for k in ("beam_x", "beam_y", "distance", "N_a", "N_b", "N_c")}
    known.update({k: ds.shared_start[k] for k in ("cell_a", "cell_b", "cell_c")})
    return names, ",".join(f"{k}={v!r}" for k, v in known.items())


def test_screened_run_drops_the_bad_stills_and_takes_more_later(refine_cli, tmp_path, serial_set):
    names, start = _write(serial_set, tmp_path)
    bad = {names[i] for i in serial_set.bad()}
    common = ("--model", "@{stem}.txt", "--joint", "--symmetry", "cubic", "--start", start)
    r = refine_cli("--images", *names[:8], *common, "--screen", "--out-dir", "run1")
    assert r.code == 0, r.err
    doc = json.loads((r.tmp / "run1" / "joint.json").read_text())
    serial = doc["serial"]
    # the bad stills dropped, each with its reason, in the printed summary and joint.json; the run went on
    assert {d["image"] for d in serial["dropped"]} == bad and serial["n_used"] == 6 and doc["n_images"] == 6
    assert "8 images: 6 used, 2 dropped (" in r.out
    for d in serial["dropped"]:
        assert d["reason"].startswith(("fit far worse than the others", "failed start", "no diffraction"))
        assert f"{d['image']}: dropped in round {d['round']}: {d['reason']}" in r.out
    # the shared cell near the truth (48 A; the start was 0.5 % off)
    esd = doc["shared_esds"]["cell_a"]
    assert 0 < esd < 0.01 and abs(doc["shared"]["cell_a"] - 48.0) < max(4 * esd, 0.005)
    # joint.h5: one row per still with its file name and reason
    with h5py.File(r.tmp / "run1" / "joint.h5", "r") as h5:
        g = h5["serial"]
        assert json.loads(g.attrs["sources"]) == names[:8] and g.attrs["n_dropped"] == 2
        assert [names[i] for i in range(8) if not g["used"][i]] == sorted(bad)
        assert all(g["reason"][i] for i in range(8) if not g["used"][i])

    # two more stills added to the finished run: the earlier ones continue from their refined values
    r2 = refine_cli("--images", *names, *common, "--add-to", "run1/joint.h5", "--out-dir", "run2")
    assert r2.code == 0, r2.err
    assert "the first 8 continue from run1/joint.h5" in r2.out
    doc2 = json.loads((r2.tmp / "run2" / "joint.json").read_text())
    s2 = doc2["serial"]
    assert s2["n_images"] == 10 and s2["used"] == [n for n in names if n not in bad]
    assert s2["previous_images"] == 8 and "10 images: 8 used, 2 dropped (" in r2.out
    assert all(d["reason"].startswith(("dropped before: ", "failed start")) for d in s2["dropped"])
    # round 1 starts the six earlier stills at their refined values: it converges before the 12 screening steps
    # that the first run needed, and leaves them where they were
    assert serial["rounds"][0]["steps"] == 12 and s2["rounds"][0]["steps"] < 12
    for before, after in zip(doc["images"], doc2["images"][:6]):
        for name in ("scale", "misset_x", "misset_y", "misset_z"):
            assert after["initial_params"][name] == pytest.approx(before["params"][name], rel=1e-4, abs=1e-4)
    assert abs(doc2["shared"]["cell_a"] - 48.0) < max(4 * doc2["shared_esds"]["cell_a"], 0.005)
    print(serial["rounds"], s2["rounds"], doc["shared"]["cell_a"], esd, doc2["shared"]["cell_a"])
