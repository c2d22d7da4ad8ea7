"""A rotation series (nbtorch-refine --images ... --rotation-series; refine.modes.joint): a wedge of five
consecutive 0.1 deg rotation images of one crystal, each a CBF with its own Start_angle/Angle_increment,
refined together (one cell and orientation, each image's scale and background) and compared with the
images refined one by one.  No image is summed: each image's phi start and width come from its own header.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cli_helpers import simulate
from nbtorch.io.cbf import write_cbf
from refine.inputs.problems import misorientation_deg

#: the crystal and the wedge: 5 images of 0.1 deg from phi 10 deg (the model's -phisteps 5: a step per 0.02 deg)
CELL, MISSET = (30.0, 40.0), (10.0, 20.0, 30.0)
CRYSTAL = "-N 5 -default_F 100 -mosaic 0.2 -mosaic_dom 2 -oversample 1"
GEOMETRY = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48 -Xbeam 2.45 -Ybeam 2.45"
PHI0, OSC, N_IMAGES, BACKGROUND = 10.0, 0.1, 5, 2.0
#: the start: the cell 0.3 % long, the orientation about 0.15 deg off
START = f"-cell 30.09 30.09 40.12 90 90 90 -misset 10.1 19.9 30.1 {CRYSTAL}"
HEADER = {"wavelength_A": 1.0, "distance_mm": 40.0, "pixel_size_mm": 0.1, "beam_x_px": 25.0, "beam_y_px": 25.0}


@pytest.fixture(scope="module")
def wedge(tmp_path_factory):
    """The five CBFs (Poisson noise over a background of 2 photons), their rotation only in the header."""
    folder = tmp_path_factory.mktemp("wedge")
    truth = f"-cell {CELL[0]} {CELL[0]} {CELL[1]} 90 90 90 -misset {' '.join(map(str, MISSET))} {CRYSTAL} {GEOMETRY}"
    for k in range(N_IMAGES):
        phi = round(PHI0 + k * OSC, 6)
        img = simulate(f"{truth} -phi {phi} -osc {OSC} -phisteps 5", background=BACKGROUND, seed=30 + k)
        write_cbf(folder / f"img_{k}.cbf", img, {**HEADER, "start_angle_deg": phi, "angle_increment_deg": OSC})
    return folder


def _errors(params: dict) -> tuple[float, float]:
    """(relative cell error (rms over a and c), misorientation in deg) of refined parameters."""
    cell = math.hypot(params["cell_a"] / CELL[0] - 1.0, params["cell_c"] / CELL[1] - 1.0) / math.sqrt(2.0)
    return cell, misorientation_deg([params[f"misset_{x}"] for x in "xyz"], MISSET)


def test_rotation_series_refines_one_crystal_better_than_single_images(refine_cli, wedge):
    r = refine_cli("--images", str(wedge / "img_*.cbf"), "--rotation-series", "--model", START, "--symmetry",
                   "tetragonal", "--max-steps", "60", "--out-dir", "sweep")
    assert r.code == 0, r.err
    assert "shared: cell, orientation (decided by all images); per image: scale, background" in r.out
    for k in range(N_IMAGES):  # every image's rotation from its own header
        assert f"Start_angle {PHI0 + k * OSC:g} deg, Angle_increment 0.1 deg from the header" in r.out
    # what is the same for every image is printed once, under the first image, and the run says so
    lines = r.out.splitlines()
    first, second = lines.index(f"  {wedge / 'img_0.cbf'}:"), lines.index(f"  {wedge / 'img_1.cbf'}:")
    end = next(i for i, line in enumerate(lines) if "fitted pixels held in memory" in line)
    assert not set(lines[first + 1:second]) & set(lines[second:end])
    assert any(line.endswith("lines the same as the first image's are printed once, under it)") for line in lines)
    doc = json.loads((r.tmp / "sweep" / "joint.json").read_text())
    assert doc["status"] == "converged" and doc["n_images"] == N_IMAGES
    assert doc["shared_names"] == ["cell_a", "cell_c", "orient_x", "orient_y", "orient_z"]
    assert doc["per_image_names"] == ["scale", "background"]
    shared, esds = doc["shared"], doc["shared_esds"]
    for k, image in enumerate(doc["images"]):
        p = image["params"]
        assert p["phi0"] == pytest.approx(PHI0 + k * OSC, abs=1e-9)
        assert p["scale"] == pytest.approx(1.0, abs=0.03) and p["background"] == pytest.approx(BACKGROUND, abs=0.15)
        assert [p[f"misset_{x}"] for x in "xyz"] == [shared[f"misset_{x}"] for x in "xyz"]  # one crystal
    for name, true in (("cell_a", CELL[0]), ("cell_c", CELL[1])) + tuple(zip(("misset_x", "misset_y", "misset_z"),
                                                                              MISSET)):
        assert 0 < esds[name] < 0.02 and abs(shared[name] - true) < 4 * esds[name], (name, shared[name], esds[name])
    joint_cell, joint_orient = _errors(shared)
    start_cell, start_orient = _errors(doc["initial_shared"])
    assert joint_cell < start_cell / 5 and joint_orient < start_orient / 4, (joint_cell, start_cell, joint_orient, start_orient)
    # the same images refined one at a time (cell, orientation, scale, background each): less well determined
    singles = []
    for k in range(N_IMAGES):
        s = refine_cli("--image", str(wedge / f"img_{k}.cbf"), "--model", START, "--symmetry", "tetragonal",
                       "--refine", "cell,orientation,scale,background", "--max-steps", "60", "--quiet",
                       "--out", f"single_{k}.h5", "--json", f"single_{k}.json", *(("--no-esds",) if k else ()))
        assert s.code == 0, s.err
        singles.append(s.json(f"single_{k}.json"))
    single_errors = np.array([_errors(s["params"]) for s in singles])
    assert joint_cell < single_errors[:, 0].mean() and joint_orient < single_errors[:, 1].mean(), single_errors
    assert esds["cell_a"] < singles[0]["esds"]["cell_a"] / 1.5 and esds["cell_c"] < singles[0]["esds"]["cell_c"] / 1.5


def test_rotation_series_refuses_one_rotation_for_every_image(refine_cli, wedge):
    r = refine_cli("--images", str(wedge / "img_*.cbf"), "--rotation-series", "--model", f"{START} -phi 10 -osc 0.1")
    assert r.code == 2 and r.err.count("\n") == 1
    assert "img_0.cbf and " in r.err and "img_1.cbf have the same rotation (-phi 10 -osc 0.1)" in r.err


def test_rotation_series_refuses_a_still_and_needs_images(refine_cli, tmp_path):
    write_cbf(tmp_path / "still.cbf", simulate(f"-cell 30 30 40 90 90 90 {CRYSTAL} {GEOMETRY}"), HEADER)
    r = refine_cli("--images", "still.cbf", "--rotation-series", "--model", START)
    assert r.code == 2 and r.err.count("\n") == 1
    assert "--rotation-series: still.cbf is a still (no oscillation in its header or --model)" in r.err
    r = refine_cli("--image", "still.cbf", "--rotation-series", "--model", START)
    assert r.code == 2 and "--rotation-series: only with --images" in r.err
