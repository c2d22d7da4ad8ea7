"""nbtorch.dials.geometry: DIALS experiments as nanoBragg flags and back, checked on real DIALS files.

* the frame change is a proper rotation taking DIALS' beam (0, 0, -1) to nanoBragg's (1, 0, 0);
* .expt -> flags -> Simulator -> .expt reproduces every refined field to 1e-9;
* the Bragg spots of the model built from the .expt land where DIALS predicted them (``xyzcal``):
  stills within 0.5 px of ``xyzcal.px`` (which includes DIALS' parallax correction) and to 1e-6 px of
  the plane intersection ``xyzcal.mm / pixel`` once DIALS' stills rotation ``delpsical.rad`` is applied;
  a rotation scan to 1e-6 px at each reflection's calculated spindle angle;
* the Simulator's rendered still spots have centroids within 0.5 px of ``xyzcal.px``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from nbtorch import Simulator, config_from_args
from nbtorch.dials.geometry import (
    NB_FROM_DIALS, bragg_positions_px, dials_from_nb, dials_origin_mm, experiment_flags, misset_from_rotation_deg, nb_from_dials,
    refined_document, still_experiment,
)
from nbtorch.errors import InputError
from nbtorch.io.dials import read_expt, read_refl, write_expt
from nbtorch.physics.rotation import rotation_matrix_xyz

DATA = Path(__file__).resolve().parent / "data" / "dials"
STILLS = DATA / "cunir_ssx_indexed"
SCAN = DATA / "centroid_rotation_indexed"
CASES = [(STILLS, 0), (STILLS, 1), (STILLS, 4), (SCAN, 0)]


def _sim(exp, image_index: int = 0, extra=()) -> Simulator:
    cfg = config_from_args(experiment_flags(exp, image_index) + ["-N", "5", "-default_F", "1", *extra])
    return Simulator(cfg, dtype=torch.float64)


def test_frame_change_is_a_proper_rotation() -> None:
    assert np.allclose(NB_FROM_DIALS @ NB_FROM_DIALS.T, np.eye(3)) and np.linalg.det(NB_FROM_DIALS) == 1.0
    assert np.array_equal(nb_from_dials([0, 0, -1]), [1, 0, 0])  # the beam
    assert np.array_equal(nb_from_dials([1, 0, 0]), [0, 0, 1])  # horizontal: nanoBragg's spindle / E-vector
    assert np.array_equal(nb_from_dials([0, 1, 0]), [0, 1, 0])  # up
    v = np.random.default_rng(1).normal(size=(4, 3))
    assert np.allclose(dials_from_nb(nb_from_dials(v)), v)


def test_dials_origin_is_dials_from_nb_of_pix0_in_mm() -> None:
    """The SMV header's DIALS_ORIGIN (nbtorch.cli.main) is the frame change of 1000 pix0, bit for bit, a zero keeping the
    sign the C prints: (1000 pix0_z, 1000 pix0_y, -1000 pix0_x)."""
    for pix0 in np.random.default_rng(2).normal(size=(20, 3)) * 0.1:
        assert np.array_equal(dials_origin_mm(pix0), dials_from_nb(1000 * pix0))
        assert dials_origin_mm(pix0) == (1000 * pix0[2], 1000 * pix0[1], -1000 * pix0[0])
    assert [str(v) for v in dials_origin_mm([0.0, -0.0, 0.1])] == ["100.0", "-0.0", "-0.0"]


def test_misset_angles_invert_rotation_matrix_xyz() -> None:
    for angles in ((10.0, 20.0, 30.0), (-129.5, -36.9, 38.0), (170.0, -80.0, -5.0)):
        u = rotation_matrix_xyz(*(torch.tensor(np.radians(a), dtype=torch.float64) for a in angles)).numpy()
        assert np.allclose(misset_from_rotation_deg(u), angles, atol=1e-10)


def test_flags_of_a_still() -> None:
    flags = experiment_flags(read_expt(STILLS.with_suffix(".expt"), 1))
    cfg = config_from_args(flags)
    assert cfg.convention == "custom" and cfg.pivot == "sample"
    assert cfg.wavelength_A == 1.37611 and cfg.pixel_mm == pytest.approx(0.172) and (cfg.fpixels, cfg.spixels) == (2463, 2527)
    assert cfg.beam_vector == (1.0, 0.0, 0.0) and cfg.polar_vector == (0.0, 0.0, 1.0)
    assert cfg.polarization == pytest.approx(0.998)
    assert cfg.cell == pytest.approx((96.408165,) * 3 + (90.0,) * 3)  # CuNiR, cubic
    assert "-phi" not in flags and "-spindle_axis" not in flags


@pytest.mark.parametrize("stem,index", CASES)
def test_expt_model_expt_round_trip(stem: Path, index: int, tmp_path: Path) -> None:
    exp = read_expt(stem.with_suffix(".expt"), index)
    image = 3 if exp.scan else 0
    doc = refined_document(exp, _sim(exp, image), {}, image)
    original, ex, ex0 = exp.document, doc["experiment"][index], exp.document["experiment"][index]
    fields = [("beam", ("direction", "wavelength", "polarization_fraction")),
              ("crystal", ("real_space_a", "real_space_b", "real_space_c"))]
    for kind, keys in fields:
        for key in keys:
            assert np.allclose(doc[kind][ex[kind]][key], original[kind][ex0[kind]][key], rtol=0, atol=1e-9), key
    for key in ("origin", "fast_axis", "slow_axis"):
        assert np.allclose(doc["detector"][ex["detector"]]["panels"][0][key], exp.panel[key], rtol=0, atol=1e-9)
    # everything else is untouched, and the file is valid JSON that reads back
    assert doc["imageset"] == original["imageset"] and doc["scan"] == original["scan"]
    out = tmp_path / "back.expt"
    out.write_text(json.dumps(doc))
    assert read_expt(out, index).crystal["space_group_hall_symbol"] == exp.crystal["space_group_hall_symbol"]


def test_refined_values_move_the_written_model() -> None:
    exp = read_expt(STILLS.with_suffix(".expt"), 0)
    sim = _sim(exp)
    p = sim.setup.params
    doc = refined_document(exp, sim, {"wavelength": 1.4, "distance": p["distance"] + 1.0, "orient_z": 0.5})
    ex = doc["experiment"][0]  # its own beam, detector and crystal (the file's five stills share them)
    assert doc["beam"][ex["beam"]]["wavelength"] == 1.4
    moved = np.asarray(doc["detector"][ex["detector"]]["panels"][0]["origin"]) - exp.panel["origin"]
    assert np.allclose(moved, [0.0, 0.0, -1.0], atol=3e-3)  # ~1 mm along the normal (SAMPLE pivot), DIALS -z
    a0, a1 = np.asarray(exp.crystal["real_space_a"]), np.asarray(doc["crystal"][ex["crystal"]]["real_space_a"])
    assert np.linalg.norm(a1) == pytest.approx(np.linalg.norm(a0)) and not np.allclose(a0, a1)


def test_a_shared_model_is_copied_for_the_refined_experiment(tmp_path: Path) -> None:
    """The five CuNiR stills share one beam and one detector: writing experiment 2's refined geometry gives it
    its own copies and leaves the other four experiments' models as they were (values and indices)."""
    exp = read_expt(STILLS.with_suffix(".expt"), 2)
    sim = _sim(exp)
    doc = refined_document(exp, sim, {"wavelength": 1.4, "distance": sim.setup.params["distance"] + 1.0})
    original = exp.document
    assert [e["beam"] for e in original["experiment"]] == [0] * 5  # shared in the file
    assert doc["experiment"][2]["beam"] == len(original["beam"]) and doc["beam"][-1]["wavelength"] == 1.4
    assert doc["experiment"][2]["detector"] == len(original["detector"])
    for i in (0, 1, 3, 4):
        assert doc["experiment"][i] == original["experiment"][i]
    for kind in ("beam", "detector"):
        assert doc[kind][:len(original[kind])] == original[kind], kind
    own = original["experiment"][2]["crystal"]  # its own crystal (not shared): refined where it is
    assert doc["experiment"][2]["crystal"] == own and len(doc["crystal"]) == len(original["crystal"])
    assert [c for i, c in enumerate(doc["crystal"]) if i != own] == [c for i, c in enumerate(original["crystal"])
                                                                     if i != own]
    path = tmp_path / "out.expt"
    write_expt(path, doc)
    assert read_expt(path, 0).beam == exp.beam and read_expt(path, 2).beam["wavelength"] == 1.4


def _reflections(stem: Path, index: int, *extra: str) -> dict:
    r = read_refl(stem.with_suffix(".refl"), ("miller_index", "xyzcal.px", "xyzcal.mm", *extra), experiment_id=index)
    predicted = np.any(r["xyzcal.mm"] != 0, axis=1)  # rows DIALS did not predict have zeros
    return {k: v[predicted] for k, v in r.items()}


@pytest.mark.parametrize("index", [0, 1, 4])
def test_still_spots_where_dials_predicts_them(index: int) -> None:
    exp = read_expt(STILLS.with_suffix(".expt"), index)
    sim = _sim(exp)
    r = _reflections(STILLS, index, "delpsical.rad")
    assert len(r["miller_index"]) > 20
    pixel = exp.panel["pixel_size"][0]
    on_sphere = bragg_positions_px(sim, {}, r["miller_index"], 0.0, r["delpsical.rad"])
    assert np.abs(on_sphere - r["xyzcal.px"][:, :2]).max() < 0.5  # DIALS' parallax correction: up to 0.3 px
    assert np.abs(on_sphere - r["xyzcal.mm"][:, :2] / pixel).max() < 1e-6
    plain = bragg_positions_px(sim, {}, r["miller_index"], 0.0)  # the lattice point off the Ewald sphere
    assert np.abs(plain - r["xyzcal.px"][:, :2]).max() < 1.0


def test_rotation_scan_spots_at_their_spindle_angles() -> None:
    exp = read_expt(SCAN.with_suffix(".expt"))
    r = _reflections(SCAN, 0)
    phi_deg = np.degrees(r["xyzcal.mm"][:, 2])
    start, width = exp.scan["oscillation"]
    assert np.allclose(phi_deg, start + r["xyzcal.px"][:, 2] * width)  # z in frames from the scan start
    for image in (0, 4):  # the datum does not depend on the image the model was built for
        sim = _sim(exp, image)
        assert sim.setup.params["phi0"] == pytest.approx(start + image * width)
        pred = bragg_positions_px(sim, {}, r["miller_index"], phi_deg)
        assert np.abs(pred - r["xyzcal.px"][:, :2]).max() < 1e-6  # SimplePxMmStrategy: px = mm / pixel
    near = np.abs(phi_deg - (start + 4.5 * width)) < width  # a few reflections near image 4
    assert near.sum() >= 5
    # the spindle sense: turning the other way misses by pixels
    wrong = bragg_positions_px(sim, {}, r["miller_index"][near], -phi_deg[near] + 2 * start)
    assert np.abs(wrong - r["xyzcal.px"][near, :2]).max() > 1.0


def test_converter_errors(tmp_path: Path) -> None:
    doc = json.loads(STILLS.with_suffix(".expt").read_text())
    doc["detector"][0]["panels"][0]["pixel_size"] = [0.172, 0.1]
    bad = tmp_path / "bad.expt"
    bad.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="not square"):
        experiment_flags(read_expt(bad))
    doc = json.loads(STILLS.with_suffix(".expt").read_text())
    doc["crystal"][0]["real_space_c"] = [-v for v in doc["crystal"][0]["real_space_c"]]
    bad.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="left-handed"):
        experiment_flags(read_expt(bad))
    with pytest.raises(InputError, match="no image 9"):
        experiment_flags(read_expt(SCAN.with_suffix(".expt")), 9)


def test_rendered_still_spots_on_dials_predictions() -> None:
    """The Simulator's own spots (rendered in windows around them) have centroids within 0.5 px of xyzcal.px."""
    from refine.inputs.spots import spot_offsets

    exp = read_expt(STILLS.with_suffix(".expt"), 1)
    sim = _sim(exp, extra=("-N", "20", "-default_F", "100", "-oversample", "2"))
    cal = _reflections(STILLS, 1)["xyzcal.px"][:, :2]
    off = spot_offsets(sim, dict(sim.setup.params), cal)
    assert off.matched.all()
    assert np.abs(off.predicted - cal).max() < 0.5 and off.rms() < 0.3


# --- dxtbx itself reads what nbtorch writes (opt-in: DIALS cannot be installed from pip) -------------------

DXTBX_PYTHON = os.environ.get("NBTORCH_DXTBX_PYTHON", "")


def _dxtbx_view(*paths: Path) -> dict:
    """What dxtbx's ExperimentListFactory makes of each file (tests/dxtbx_dump.py run by NBTORCH_DXTBX_PYTHON)."""
    script = Path(__file__).resolve().parent / "dxtbx_dump.py"
    done = subprocess.run([DXTBX_PYTHON, str(script), *map(str, paths)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def _assert_dxtbx_sees_our_values(seen: list[dict], path: Path) -> None:
    """dxtbx's reading of every experiment of ``path`` equals nbtorch's (read_expt) to 1e-9."""
    assert len(seen) == read_expt(path).n_experiments()
    for i, s in enumerate(seen):
        ours = read_expt(path, i)
        assert s["wavelength"] == pytest.approx(ours.beam["wavelength"], rel=1e-12)
        assert np.allclose(s["direction"], _unit(ours.beam["direction"]), rtol=0, atol=1e-12)
        for key in ("origin", "fast_axis", "slow_axis", "pixel_size", "image_size"):
            assert np.allclose(s["panels"][0][key], ours.panel[key], rtol=0, atol=1e-9), (path.name, i, key)
        for got, key in zip(s["real_space"], ("real_space_a", "real_space_b", "real_space_c")):
            assert np.allclose(got, ours.crystal[key], rtol=0, atol=1e-9), (path.name, i, key)
        assert s["hall"].strip() == ours.crystal["space_group_hall_symbol"].strip()
        assert (s["goniometer"] is None) == (ours.goniometer is None) and (s["scan"] is None) == (ours.scan is None)


@pytest.mark.skipif(not DXTBX_PYTHON, reason="set NBTORCH_DXTBX_PYTHON to a Python with DIALS' dxtbx (e.g. the "
                                             "path of dials.python) to check that dxtbx reads the .expt files "
                                             "nbtorch writes")
def test_dxtbx_reads_the_expt_files_nbtorch_writes(tmp_path: Path) -> None:
    """The files nbtorch-refine --expt-out writes -- a refined still (wavelength, distance, orientation moved), a
    refined rotation scan, a new still experiment for a model given by flags -- are read by dxtbx itself
    (ExperimentListFactory, the reader of every DIALS program) as the values nbtorch meant, and the refined
    changes are what dxtbx sees."""
    exp = read_expt(STILLS.with_suffix(".expt"), 0)
    sim = _sim(exp)
    d0 = sim.setup.params["distance"]
    write_expt(tmp_path / "still.expt", refined_document(exp, sim, {"wavelength": 1.4, "distance": d0 + 1.0,
                                                                    "orient_z": 0.5}))
    scan = read_expt(SCAN.with_suffix(".expt"), 0)
    sim_scan = _sim(scan, 3)
    write_expt(tmp_path / "scan.expt", refined_document(scan, sim_scan, {"orient_x": 0.2, "distance":
                                                                         sim_scan.setup.params["distance"] - 0.5}, 3))
    write_expt(tmp_path / "new.expt", refined_document(still_experiment(sim, "obs.cbf", " P 2ac 2ab"), sim, {}))
    paths = [tmp_path / n for n in ("still.expt", "scan.expt", "new.expt")]
    seen = _dxtbx_view(STILLS.with_suffix(".expt"), SCAN.with_suffix(".expt"), *paths)
    for path in paths:
        _assert_dxtbx_sees_our_values(seen[str(path)], path)
    before, still = seen[str(STILLS.with_suffix(".expt"))], seen[str(paths[0])]
    assert still[0]["wavelength"] == 1.4 and before[0]["wavelength"] != 1.4
    assert still[0]["panels"][0]["distance"] == pytest.approx(before[0]["panels"][0]["distance"] + 1.0, abs=3e-3)
    assert not np.allclose(still[0]["real_space"], before[0]["real_space"])
    assert still[1:] == before[1:]  # the other experiments of the file: untouched
    scan_before, scan_after = seen[str(SCAN.with_suffix(".expt"))][0], seen[str(paths[1])][0]
    assert scan_after["scan"] == scan_before["scan"] and scan_after["goniometer"] == scan_before["goniometer"]
    assert scan_after["panels"][0]["distance"] == pytest.approx(scan_before["panels"][0]["distance"] - 0.5, abs=3e-3)
    new = seen[str(paths[2])][0]  # the model written from flags alone is exp 0's geometry
    assert np.allclose(new["panels"][0]["origin"], before[0]["panels"][0]["origin"], rtol=0, atol=1e-6)
    assert np.allclose(new["real_space"], before[0]["real_space"], rtol=0, atol=1e-6)
    assert new["hall"].strip() == "P 2ac 2ab"
