"""nbtorch-refine --images ... --joint (refine.modes.joint): stills of one crystal at different orientations
refined together from the command line; the options' checks."""

from __future__ import annotations

import json

import pytest

from cli_helpers import simulate
from nbtorch.io.cbf import write_cbf

GEOMETRY = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48 -Xbeam 2.45 -Ybeam 2.45"
CRYSTAL = "-N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
MISSETS = ("10 20 30", "-40 5 75")


def test_joint_command_refines_a_shared_cell(refine_cli, tmp_path):
    for k, misset in enumerate(MISSETS):
        img = simulate(f"-cell 30 30 40 90 90 90 -misset {misset} {CRYSTAL} {GEOMETRY}", background=1.0, seed=20 + k)
        write_cbf(tmp_path / f"still_{k}.cbf", img, {"pixel_size_mm": 0.1})
    # per-image models: the orientation follows the image ({stem}: still_0, still_1), the cell starts 0.3 % off
    (tmp_path / "still_0.txt").write_text(f"-cell 30.09 30.09 40.12 90 90 90 -misset {MISSETS[0]} {CRYSTAL} {GEOMETRY}")
    (tmp_path / "still_1.txt").write_text(f"-cell 30.09 30.09 40.12 90 90 90 -misset {MISSETS[1]} {CRYSTAL} {GEOMETRY}")
    r = refine_cli("--images", "still_0.cbf", "still_1.cbf", "--model", "@{stem}.txt", "--joint", "--shared", "cell",
                   "--symmetry", "tetragonal", "--max-steps", "40", "--out-dir", "joint")
    assert r.code == 0, r.err
    doc = json.loads((r.tmp / "joint" / "joint.json").read_text())
    assert doc["n_images"] == 2 and doc["shared_names"] == ["cell_a", "cell_c"]
    assert doc["per_image_names"] == ["orient_x", "orient_y", "orient_z", "scale", "background"]
    assert doc["shared"]["cell_a"] == pytest.approx(30.0, abs=0.03)
    assert doc["shared"]["cell_c"] == pytest.approx(40.0, abs=0.04)
    assert doc["shared_esds"]["cell_a"] > 0 and (r.tmp / "joint" / "joint.h5").is_file()
    assert "joint refinement of 2 images" in r.out
    # the same job stopped after 3 steps (a checkpoint every 2 steps and at the end) and resumed: same result
    args = ("--images", "still_0.cbf", "still_1.cbf", "--model", "@{stem}.txt", "--joint", "--symmetry", "tetragonal")
    r = refine_cli(*args, "--max-steps", "3", "--checkpoint-every", "2", "--out-dir", "part")
    assert r.code == 0, r.err
    assert (r.tmp / "part" / "joint.ckpt.h5").is_file() and json.loads((r.tmp / "part" / "joint.json").read_text())["steps"] == 3
    r = refine_cli(*args, "--max-steps", "40", "--out-dir", "part", "--resume")
    assert r.code == 0, r.err
    assert "resumed from step 3" in r.out
    resumed = json.loads((r.tmp / "part" / "joint.json").read_text())
    assert resumed["resumed_from_step"] == 3 and doc["resumed_from_step"] is None
    for key in ("shared", "shared_esds", "images", "loss_final", "steps", "evaluations", "history"):
        assert resumed[key] == doc[key], key
    # another job's settings are refused in one line
    r = refine_cli(*args, "--per-image", "scale,background", "--out-dir", "part", "--resume")
    assert r.code == 2 and r.err.count("\n") == 1
    assert "was written for another joint problem or settings (differs: per-image names)" in r.err
    r = refine_cli(*args, "--out-dir", "elsewhere", "--resume")
    assert r.code == 2 and "--resume: checkpoint elsewhere/joint.ckpt.h5 not found" in r.err


@pytest.mark.parametrize("argv, message", [
    (("--problem", "cubic_mosflm", "--joint"), "--joint: only with --images and --joint"),
    (("--images", "a.cbf", "--shared", "cell"), "--shared: only with --images and --joint"),
    (("--problem", "cubic_mosflm", "--per-image", "scale"), "--per-image: only with --images and --joint"),
])
def test_joint_options_need_images_and_joint(refine_cli, argv, message):
    r = refine_cli(*argv)
    assert r.code == 2 and message in r.err


def test_joint_pixels_read_from_files_give_the_same_result(refine_cli, tmp_path):
    """--pixel-memory 0: every image's fitted pixels go to OUT_DIR/pixels/ and are read back at each evaluation;
    the result is the same as with the pixels held, and the files are gone at the end."""
    for k, misset in enumerate(MISSETS):
        img = simulate(f"-cell 30 30 40 90 90 90 -misset {misset} {CRYSTAL} {GEOMETRY}", background=1.0, seed=40 + k)
        write_cbf(tmp_path / f"still_{k}.cbf", img, {"pixel_size_mm": 0.1})
        (tmp_path / f"still_{k}.txt").write_text(f"-cell 30.09 30.09 40.12 90 90 90 -misset {misset} {CRYSTAL} {GEOMETRY}")
    args = ("--images", "still_0.cbf", "still_1.cbf", "--model", "@{stem}.txt", "--joint", "--symmetry", "tetragonal",
            "--max-steps", "3", "--no-esds")
    held = refine_cli(*args, "--out-dir", "held")
    assert held.code == 0, held.err
    assert "fitted pixels held in memory" in held.out and "read from" not in held.out
    stored = refine_cli(*args, "--out-dir", "stored", "--pixel-memory", "0")
    assert stored.code == 0, stored.err
    assert "fitted pixels held in memory: 0.0 MB; the pixels of 2 images read from stored/pixels/" in stored.out
    assert not list((stored.tmp / "stored" / "pixels").glob("*"))
    a, b = (json.loads((r.tmp / d / "joint.json").read_text()) for r, d in ((held, "held"), (stored, "stored")))
    for key in ("shared", "images", "loss_final", "steps", "evaluations"):
        assert a[key] == b[key], key
    r = refine_cli(*args, "--out-dir", "x", "--pixel-memory", "-1")
    assert r.code == 2 and "--pixel-memory: expected megabytes >= 0, got -1" in r.err
    r = refine_cli("--problem", "cubic_mosflm", "--pixel-memory", "10")
    assert r.code == 2 and "--pixel-memory: only with --images and --joint" in r.err
