"""Independent mode (nbtorch-refine --images, refine.many.batch): every image refined on its own, bad ones recorded with
their reason, a summary table, resume after an interruption, and sharding over torchrun processes."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from cli_helpers import simulate
from nbtorch.errors import InputError
from nbtorch.io.cbf import write_cbf
from refine.many.batch import SUMMARY_COLUMNS, expand_image_list, image_stem

CRYSTAL = "-cell 30 30 40 90 90 90 -misset 10 20 30 -N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
GEOMETRY = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48"
#: the starting model: beam centre off by about half a pixel
MODEL = f"{CRYSTAL} {GEOMETRY} -Xbeam 2.5 -Ybeam 2.4"
OPTIONS = ("--refine", "scale,background,beam_centre", "--max-steps", "8", "--spots", "find", "--spot-window", "3",
           "--no-esds", "--no-compile")


def _stills(tmp_path: Path, n: int = 2) -> list[Path]:
    out = []
    for i in range(n):
        img = simulate(f"{CRYSTAL} {GEOMETRY} -Xbeam 2.45 -Ybeam 2.45", background=1.0, seed=10 + i)
        out.append(tmp_path / f"still_{i:04d}.cbf")
        write_cbf(out[-1], img, {"pixel_size_mm": 0.1})
    return out


def _summary(folder: Path) -> list[dict]:
    with open(folder / "summary.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_bad_images_are_recorded_and_the_others_refined(refine_cli, tmp_path):
    good = _stills(tmp_path)
    (tmp_path / "corrupt.cbf").write_bytes(b"###CBF: VERSION 1.5\n" + bytes(range(256)) * 4)
    write_cbf(tmp_path / "empty.cbf", np.zeros((48, 48), dtype=np.int32), {"pixel_size_mm": 0.1})
    r = refine_cli("--images", *map(str, good), "corrupt.cbf", "empty.cbf", "--model", MODEL, *OPTIONS,
                   "--out-dir", "batch")
    assert r.code == 1  # some failed
    rows = {Path(row["image"]).name: row for row in _summary(r.tmp / "batch")}
    assert list(rows) == ["still_0000.cbf", "still_0001.cbf", "corrupt.cbf", "empty.cbf"]
    for name in ("still_0000.cbf", "still_0001.cbf"):
        assert rows[name]["status"] == "converged" or rows[name]["status"] == "max_steps", rows[name]
        assert float(rows[name]["spot_rms_px_final"]) < float(rows[name]["spot_rms_px_start"])
        assert float(rows[name]["cell_a"]) == pytest.approx(30.0)
        assert (r.tmp / "batch" / Path(name).stem / "result.h5").is_file()
    assert rows["corrupt.cbf"]["status"] == "error" and "corrupt.cbf" in rows["corrupt.cbf"]["reason"]
    assert rows["empty.cbf"]["status"] == "error" and "spot" in rows["empty.cbf"]["reason"]
    assert (r.tmp / "batch" / "corrupt" / "error.txt").read_text().count("\n") == 1
    with h5py.File(r.tmp / "batch" / "summary.h5", "r") as h5:
        assert set(h5) == set(SUMMARY_COLUMNS)
        assert [s.decode() for s in h5["status"][()]][2:] == ["error", "error"]
        assert np.isfinite(h5["cell_a"][0]) and np.isnan(h5["cell_a"][2])
    assert "2 of 4 images refined, 2 failed" in r.out
    assert "failed: corrupt.cbf" in r.out


def test_resume_keeps_done_images(refine_cli, tmp_path):
    """A second run of the same command refines only what is missing; --redo refines everything again."""
    good = _stills(tmp_path)
    args = ("--images", *map(str, good), "--model", MODEL, *OPTIONS, "--out-dir", "b")
    first = refine_cli(*args)
    assert first.code == 0, first.err
    done = tmp_path / "b" / "still_0000" / "result.json"
    stamp = done.stat().st_mtime_ns
    (tmp_path / "b" / "still_0001" / "result.json").unlink()  # as if killed during the second image
    again = refine_cli(*args)
    assert again.code == 0
    assert done.stat().st_mtime_ns == stamp and "done before, kept" in again.out
    assert (tmp_path / "b" / "still_0001" / "result.json").is_file()
    refine_cli(*args, "--redo")
    assert done.stat().st_mtime_ns != stamp


def test_stem_fills_per_image_inputs(refine_cli, tmp_path):
    """{stem} in --spots picks each image's own spot list."""
    good = _stills(tmp_path)
    for path in good:
        (tmp_path / f"{path.stem}_spots.txt").write_text("1000 1000\n")  # outside the detector: no spot inside
    r = refine_cli("--images", *map(str, good), "--model", MODEL, "--refine", "scale", "--spots", "{stem}_spots.txt",
                   "--no-esds", "--no-compile", "--out-dir", "s")
    rows = _summary(tmp_path / "s")
    assert r.code == 1 and [row["status"] for row in rows] == ["error", "error"]
    assert all(f"{Path(row['image']).stem}_spots.txt" in row["reason"] for row in rows)


def test_image_list_forms(tmp_path):
    for name in ("a_0001.cbf.bz2", "a_0002.cbf.bz2", "b.img"):
        (tmp_path / name).write_bytes(b"x")
    listing = tmp_path / "list.txt"
    listing.write_text("# stills\nb.img\n\na_0002.cbf.bz2  # again\n")
    got = expand_image_list([str(tmp_path / "a_*.cbf.bz2"), f"@{listing}"])
    assert [Path(p).name for p in got] == ["a_0001.cbf.bz2", "a_0002.cbf.bz2", "b.img"]
    assert image_stem("x/thau_3_2_0003.cbf.bz2") == "thau_3_2_0003" and image_stem("b.img") == "b"
    with pytest.raises(InputError, match="no file matches"):
        expand_image_list([str(tmp_path / "c_*.cbf")])
    with pytest.raises(InputError, match="list file not found"):
        expand_image_list(["@nope.txt"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.img").write_bytes(b"x")
    with pytest.raises(InputError, match="have the same name 'b'"):
        expand_image_list([str(tmp_path / "b.img"), str(tmp_path / "d" / "b.img")])


def test_torchrun_shards_images_over_two_processes(tmp_path):
    """torchrun --nproc-per-node 2: each process refines every other image (gloo on loopback); process 0 writes
    the summary of all of them; each image's result is the one-process run's, bit for bit (one thread each)."""
    good = _stills(tmp_path, 3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1"}
    args = ["-m", "refine.cli", "--images", *map(str, good), "--model", MODEL, *OPTIONS]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(29500 + os.getpid() % 1000), *args, "--out-dir", str(tmp_path / "dist")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one = subprocess.run([sys.executable, *args, "--out-dir", str(tmp_path / "one")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    def timeless(doc):  # the result without its wall times and the command line (another --out-dir)
        if isinstance(doc, dict):
            return {k: timeless(v) for k, v in doc.items() if k != "command" and not k.endswith(("wall_s", "_s"))}
        return [timeless(v) for v in doc] if isinstance(doc, list) else doc
    for image in good:
        a, b = (json.loads((tmp_path / d / image.stem / "result.json").read_text()) for d in ("one", "dist"))
        assert a["params"] and timeless(a) == timeless(b), image.name
    rows = _summary(tmp_path / "dist")
    assert [Path(r["image"]).name for r in rows] == [p.name for p in good]
    assert all(r["status"] in ("converged", "max_steps") for r in rows)
    assert "(rank 0 of 2)" in done.stdout and "(rank 1 of 2)" in done.stdout
    assert done.stdout.count("summary:") == 1


def test_batch_options_need_images(refine_cli):
    r = refine_cli("--problem", "cubic_mosflm", "--out-dir", "x")
    assert r.code == 2 and r.err.strip() == "nbtorch-refine: error: --out-dir: only with --images (independent mode)"


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_images_refuse_one_result_file(refine_cli, tmp_path, flag):
    """With --images the results are a folder per image: a single --out/--json would be silently ignored."""
    r = refine_cli("--images", "a.cbf", "b.cbf", flag, str(tmp_path / "r.json"))
    assert r.code == 2 and r.err.strip() == (f"nbtorch-refine: error: {flag}: with --images the results go to a "
                                             "folder per image under --out-dir, not to one file")
    assert not (tmp_path / "r.json").exists()
