"""nbtorch-refine --images ... --joint --screen / --add-to (refine.modes.serial): a serial set of stills written as
CBF files, refined in rounds with the images that do not fit dropped and listed; more images added to the
finished run; the options' checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
FIRST = 6  # the stills of the first run


@pytest.fixture(scope="module")
def serial_set():
    """8 stills of SIZE x SIZE px: images 0-5 with two bad ones (another crystal form: its spots miss the start;
    no lattice: blobs and a streak), 6-7 good."""
    ds = make_serial(12, np.random.default_rng(5), size=SIZE, bad_fraction=0.17)
    bad = [i for i, im in enumerate(ds.images) if im.kind in ("wrong_crystal", "garbage")]
    good = [i for i, im in enumerate(ds.images) if im.kind == "good"]
    assert len(bad) == 2 and len(good) == 10
    order = good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:6]
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


def _torchrun(directory: Path, argv: list[str]) -> dict:
    """``nbtorch-refine argv`` under ``torchrun --nproc-per-node 2`` in ``directory`` (through a script: torchrun
    would take ``--start`` for its own ``--start-method``); the joint.json written."""
    (directory / "run_cli.py").write_text("import sys\nfrom refine.cli.main import main\n"
                                          f"sys.exit(main({argv!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(29700 + os.getpid() % 1000), "run_cli.py"]
    done = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((directory / argv[argv.index("--out-dir") + 1] / "joint.json").read_text())


def test_screened_run_drops_the_bad_stills_and_takes_more_later(refine_cli, tmp_path, serial_set):
    names, start = _write(serial_set, tmp_path)
    bad = {names[i] for i in serial_set.bad()}
    # at most 6 steps a round (a default run's round 1 takes 12, round 2 converges): the test stays short
    common = ("--model", "@{stem}.txt", "--joint", "--symmetry", "cubic", "--start", start, "--max-steps", "6")
    r = refine_cli("--images", *names[:FIRST], *common, "--screen", "--out-dir", "run1")
    assert r.code == 0, r.err
    doc = json.loads((r.tmp / "run1" / "joint.json").read_text())
    serial = doc["serial"]
    # the bad stills dropped, each with its reason, in the printed summary and joint.json; the run went on
    assert {d["image"] for d in serial["dropped"]} == bad and serial["n_used"] == 4 and doc["n_images"] == 4
    assert "6 images: 4 used, 2 dropped (" in r.out
    for d in serial["dropped"]:
        assert d["reason"].startswith(("fit far worse than the others", "failed start", "no diffraction"))
        assert f"{d['image']}: dropped in round {d['round']}: {d['reason']}" in r.out
    # the shared cell near the truth (48 A; the start was 0.5 % off)
    esd = doc["shared_esds"]["cell_a"]
    assert 0 < esd < 0.01 and abs(doc["shared"]["cell_a"] - 48.0) < max(4 * esd, 0.005)
    # joint.h5: one row per still with its file name and reason
    with h5py.File(r.tmp / "run1" / "joint.h5", "r") as h5:
        g = h5["serial"]
        assert json.loads(g.attrs["sources"]) == names[:FIRST] and g.attrs["n_dropped"] == 2
        assert [names[i] for i in range(FIRST) if not g["used"][i]] == sorted(bad)
        assert all(g["reason"][i] for i in range(FIRST) if not g["used"][i])

    # the same run under torchrun --nproc-per-node 2 (each process loads and keeps its block of 3 stills): the same bits
    two = _torchrun(tmp_path, ["--images", *names[:FIRST], *common, "--screen", "--out-dir", "run1_2p"])
    assert two["world_size"] == 2 and two["serial"]["dropped"] == serial["dropped"]
    for key in ("shared", "shared_esds"):
        assert two[key] == doc[key], key
    assert [im["params"] for im in two["images"]] == [im["params"] for im in doc["images"]]

    # two more stills added to the finished run (and a third whose model file is missing: it cannot be prepared, is
    # left out as a failed start and the run goes on): the earlier ones continue from their refined values
    (tmp_path / "run7_99.cbf").write_bytes((tmp_path / names[0]).read_bytes())
    r2 = refine_cli("--images", *names, "run7_99.cbf", *common, "--add-to", "run1/joint.h5", "--out-dir", "run2")
    assert r2.code == 0, r2.err
    assert "the first 6 continue from run1/joint.h5" in r2.out
    doc2 = json.loads((r2.tmp / "run2" / "joint.json").read_text())
    s2 = doc2["serial"]
    assert s2["n_images"] == 9 and s2["used"] == [n for n in names if n not in bad]
    assert s2["previous_images"] == 6 and "9 images: 6 used, 3 dropped (" in r2.out and "failed start: 1" in r2.out
    failed = s2["dropped"][-1]
    assert failed["image"] == "run7_99.cbf" and failed["round"] == 0 and failed["reason"].startswith("failed start (")
    assert f"run7_99.cbf: dropped in round 0: {failed['reason']}" in r2.out
    assert all(d["reason"].startswith("dropped before: ") for d in s2["dropped"][:2])
    # round 1 starts the four earlier stills at their refined values and leaves them where they were
    for before, after in zip(doc["images"], doc2["images"][:4]):
        for name in ("scale", "misset_x", "misset_y", "misset_z"):
            assert after["initial_params"][name] == pytest.approx(before["params"][name], rel=1e-4, abs=1e-4)
    assert abs(doc2["shared"]["cell_a"] - 48.0) < max(4 * doc2["shared_esds"]["cell_a"], 0.005)
    print(serial["rounds"], s2["rounds"], doc["shared"]["cell_a"], esd, doc2["shared"]["cell_a"])

    # bad values: one line, exit 2, nothing written
    for argv, message in (
            (("--images", *names[:3], *common, "--add-to", "run1/joint.h5"), "--add-to: run1/joint.h5 has 6 images, "
                                                                             "more than the 3 given now"),
            (("--images", *names[::-1], *common, "--add-to", "run1/joint.h5"), "--add-to: run1/joint.h5 was refined "
                                                                               f"with {names[0]} as image 1, now {names[-1]}"),
            (("--images", *names, *common, "--per-image", "scale,background", "--add-to", "run1/joint.h5"),
             "--add-to: run1/joint.h5 was written for another joint problem (differs: per-image names)"),
            (("--images", *names, *common, "--add-to", "run1/nothing.h5"), "--add-to: run1/nothing.h5 not found"),
            (("--images", *names, *common, "--add-to", "run7_00.txt"), "--add-to: run7_00.txt is not a readable HDF5"),
            (("--images", *names, *common, "--screen", "--resume"), "--resume: not with --screen")):
        r = refine_cli(*argv, "--out-dir", "refused")
        assert r.code == 2 and message in r.err and r.err.count("\n") == 1, r.err
        assert not (r.tmp / "refused").exists()
    before = (tmp_path / "run1" / "joint.h5").read_bytes()
    r = refine_cli("--images", *names, *common, "--add-to", "run1/joint.h5", "--out-dir", "run1")
    assert r.code == 2 and r.err.count("\n") == 1 and "--add-to run1/joint.h5: is this run's own output" in r.err, r.err
    assert (tmp_path / "run1" / "joint.h5").read_bytes() == before  # the earlier result is kept


@pytest.mark.parametrize("argv, message", [
    (("--images", "a.cbf", "--screen"), "--screen: only with --images and --joint"),
    (("--problem", "cubic_mosflm", "--add-to", "x/joint.h5"), "--add-to: only with --images and --joint"),
])
def test_serial_options_need_joint(refine_cli, argv, message):
    r = refine_cli(*argv)
    assert r.code == 2 and message in r.err and r.err.count("\n") == 1
