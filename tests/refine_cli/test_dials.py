"""nbtorch-refine --expt/--refl/--expt-out: a DIALS experiment as the starting model, its spots, the refined model
written back (a small panel cut from a real DIALS stills experiment, tests/data/dials)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import simulate
from nbtorch.dials.geometry import experiment_flags
from nbtorch.io import write_cbf
from nbtorch.io.dials import read_expt, read_refl, write_refl

STILLS = Path(__file__).resolve().parents[1] / "data" / "dials" / "cunir_ssx_indexed.expt"
CRYSTAL = "-N 5 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
SIZE = 64


def _small_expt(path: Path, shift_mm: float = 0.0) -> None:
    """Experiment 0 of the CuNiR stills with a 64 x 64 panel 100 mm from the sample (+ shift_mm away along DIALS -z),
    the beam near its centre."""
    doc = json.loads(STILLS.read_text())
    doc["experiment"] = doc["experiment"][:1]
    panel = doc["detector"][0]["panels"][0]
    panel["image_size"] = [SIZE, SIZE]
    panel["mask"] = []
    half = SIZE * 0.172 / 2
    panel["origin"] = [-half + 0.3, half, -100.0 - shift_mm]
    path.write_text(json.dumps(doc))


@pytest.fixture
def observed(tmp_path: Path) -> Path:
    """obs.cbf simulated from truth.expt, and spots.refl from its spot finder."""
    from refine.inputs.spots import find_spots

    _small_expt(tmp_path / "truth.expt")
    flags = " ".join(experiment_flags(read_expt(tmp_path / "truth.expt")))
    img = simulate(f"{flags} {CRYSTAL}", scale=1.0, background=1.0)
    write_cbf(tmp_path / "obs.cbf", img, {"pixel_size_mm": 0.172})
    spots = find_spots(img.astype(float))
    assert len(spots) >= 5
    xyz = np.c_[spots[:, :2], np.zeros(len(spots))]
    write_refl(tmp_path / "spots.refl", {"xyzobs.px.value": ("vec3<double>", xyz),
                                         "id": ("int", np.zeros(len(spots), dtype=np.int32))}, {0: "x"})
    return tmp_path


def test_expt_refl_round_trip_through_the_command(refine_cli, observed):
    r = refine_cli("--image", "obs.cbf", "--expt", "truth.expt", "--model", CRYSTAL, "--refl", "spots.refl",
                   "--refine", "scale,background", "--max-steps", "3", "--no-esds", "--expt-out", "out.expt")
    assert r.code == 0, r.err
    assert r.json()["spots"]["n"] == len(read_refl(observed / "spots.refl")["xyzobs.px.value"])
    assert r.json()["spots"]["rms_px_final_common"] < 0.5
    assert "wrote the refined DIALS experiment out.expt" in r.out
    a, b = read_expt(observed / "truth.expt"), read_expt(observed / "out.expt")
    for key in ("origin", "fast_axis", "slow_axis"):
        assert np.allclose(a.panel[key], b.panel[key], rtol=0, atol=1e-9)
    for key in ("real_space_a", "real_space_b", "real_space_c"):
        assert np.allclose(a.crystal[key], b.crystal[key], rtol=0, atol=1e-9)
    assert np.allclose(a.beam["direction"], b.beam["direction"], rtol=0, atol=1e-12)


def test_refined_distance_reaches_the_expt_out(refine_cli, observed):
    _small_expt(observed / "start.expt", shift_mm=1.5)
    r = refine_cli("--image", "obs.cbf", "--expt", "start.expt", "--model", CRYSTAL, "--refl", "spots.refl",
                   "--refine", "scale,background,distance", "--max-steps", "30", "--no-esds", "--expt-out", "out.expt")
    assert r.code == 0, r.err
    z = [read_expt(observed / f).panel["origin"][2] for f in ("truth.expt", "start.expt", "out.expt")]
    assert abs(z[2] - z[0]) < 0.3 * abs(z[1] - z[0]), z


def test_expt_out_without_expt_writes_a_new_still_experiment(refine_cli, observed):
    """A model given by nanoBragg flags alone is written as a new DIALS still experiment that reads back as the
    same model: a run started from it (no --model geometry) starts where the first one ended."""
    flags = " ".join(experiment_flags(read_expt(observed / "truth.expt")))
    first = refine_cli("--image", "obs.cbf", "--model", f"{flags} {CRYSTAL}", "--refine", "scale,background",
                       "--max-steps", "3", "--no-esds", "--symmetry", "P212121", "--expt-out", "new.expt",
                       "--json", "first.json", "--out", "first.h5")
    assert first.code == 0, first.err
    new, truth = read_expt(observed / "new.expt"), read_expt(observed / "truth.expt")
    assert new.goniometer is None and new.scan is None
    assert new.crystal["space_group_hall_symbol"].strip() == "P 2ac 2ab"
    for key in ("origin", "fast_axis", "slow_axis"):
        assert np.allclose(new.panel[key], truth.panel[key], rtol=0, atol=1e-9), key
    for key in ("real_space_a", "real_space_b", "real_space_c"):
        assert np.allclose(new.crystal[key], truth.crystal[key], rtol=0, atol=1e-9), key
    again = refine_cli("--image", "obs.cbf", "--expt", "new.expt", "--model", CRYSTAL, "--refine", "scale,background",
                       "--max-steps", "3", "--no-esds", "--json", "again.json", "--out", "again.h5")
    assert again.code == 0, again.err
    p1, p2 = first.json("first.json")["params"], again.json("again.json")["params"]
    for name in ("cell_a", "cell_b", "cell_c", "beam_x", "beam_y", "distance", "wavelength"):
        assert p2[name] == pytest.approx(p1[name], rel=1e-9, abs=1e-9), name


def test_expt_out_needs_a_measured_image(refine_cli):
    r = refine_cli("--problem", "cubic_mosflm", "--size", "16", "--expt-out", "x.expt")
    assert r.code == 2 and "--expt-out: writes the refined model of a measured image" in r.err


@pytest.mark.parametrize("argv,message", [
    (("--expt", "truth.expt", "--refl", "spots.refl", "--spots", "s.txt"), "--refl and --spots both"),
    (("--expt", "truth.expt", "--expt-index", "3"), "--expt "),
    (("--expt", "missing.expt"), "missing.expt: DIALS experiment file not found"),
    (("--expt", "truth.expt", "--refl", "truth.expt"), "--refl truth.expt: not a DIALS .refl file"),
])
def test_dials_option_errors(refine_cli, observed, argv, message):
    r = refine_cli("--image", "obs.cbf", "--model", CRYSTAL, *argv, "--no-esds")
    assert r.code == 2 and message in r.err and r.err.count("\n") == 1, r.err
