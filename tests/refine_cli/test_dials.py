"""nbtorch-refine --expt/--refl/--expt-out: a DIALS experiment as the starting model, its spots, the refined model
written back (a small panel cut from a real DIALS stills experiment, tests/data/dials)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import simulate
from nbtorch.dials_geometry import experiment_flags
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
    from refine.spots import find_spots

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


@pytest.mark.parametrize("argv,message", [
    (("--expt-out", "x.expt"), "--expt-out: writes the refined --expt; give --expt"),
    (("--expt", "truth.expt", "--refl", "spots.refl", "--spots", "s.txt"), "--refl and --spots both"),
    (("--expt", "truth.expt", "--expt-index", "3"), "--expt "),
    (("--expt", "missing.expt"), "missing.expt: DIALS experiment file not found"),
    (("--expt", "truth.expt", "--refl", "truth.expt"), "--refl truth.expt: not a DIALS .refl file"),
])
def test_dials_option_errors(refine_cli, observed, argv, message):
    r = refine_cli("--image", "obs.cbf", "--model", CRYSTAL, *argv, "--no-esds")
    assert r.code == 2 and message in r.err and r.err.count("\n") == 1, r.err
