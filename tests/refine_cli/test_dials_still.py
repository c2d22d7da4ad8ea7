"""One still from DIALS files, the natural command (issue #44): ``nbtorch-refine --image X --expt X.expt --refl X.refl``.

A synthetic still written as dials.stills_process leaves it: a ``.expt`` without a scan whose crystal carries the
mosaic model's ``ML_domain_size_ang`` and ``ML_half_mosaicity_deg`` and whose ``gaussian_rs`` profile has ``sigma_b``
(``sigma_m`` 0), the image simulated from the truth with that crystal model, and a ``.refl`` of its spots
(``xyzobs.px.value``, ``flags`` strong and indexed, ``id``, ``panel``).  The start is the truth turned by 0.15 deg, its
cell 0.5 % long and its beam centre 0.6 / 0.5 px off (distance right): what the run chooses (printed first), the
pixels it fits (the windows, not the image), the names it refines and (``-m slow``) where it ends.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import simulate
from experiments.wedge_calibration import rotation
from nbtorch.dials.geometry import experiment_flags
from nbtorch.io import write_cbf
from nbtorch.io.dials import read_expt, write_refl
from refine.inputs.dials import still_model, window_half_px
from refine.inputs.spots import find_spots, window_mask

SIZE, PIXEL, DISTANCE, CELL = 96, 0.1, 25.0, (40.0, 40.0, 60.0)
#: the crystal model the experiment's ML values give (400 A domains over 40 x 40 x 60 A, half mosaicity 0.3 deg)
CRYSTAL = "-Na 10 -Nb 10 -Nc 7 -mosaic 0.3 -mosaic_dom 40 -mosaic_model ball -default_F 100 -oversample 1"
#: the names the default refines, expanded (tetragonal cell: a and c; the mosaic group: spread and N)
EXPECTED_FREE = {"scale", "background", "orient_x", "orient_y", "orient_z", "cell_a", "cell_c", "mosaic_spread", "N",
                 "beam_x", "beam_y", "distance"}


def still_document(turn_deg: float = 0.0, cell_scale: float = 1.0, shift_px=(0.0, 0.0), crystal_model: bool = True,
                   profile: bool = True) -> dict:
    """A DIALS still experiment (no goniometer, no scan): a 96 x 96 panel of 0.1 mm normal to the beam at 25 mm, a
    tetragonal crystal (P 4) with the stills mosaic model's values, a gaussian_rs profile of a still."""
    u = rotation([0.3, -0.5, 1.0], turn_deg) @ rotation([1, 2, 3], 40.0)
    real = (u @ np.diag(np.asarray(CELL) * cell_scale)).T
    half = SIZE * PIXEL / 2
    crystal = {"__id__": "crystal", "real_space_a": list(real[0]), "real_space_b": list(real[1]),
               "real_space_c": list(real[2]), "space_group_hall_symbol": " P 4"}
    if crystal_model:
        crystal.update(ML_half_mosaicity_deg=0.3, ML_domain_size_ang=400.0)
    return {
        "__id__": "ExperimentList",
        "experiment": [{"__id__": "Experiment", "identifier": "still", "beam": 0, "detector": 0, "crystal": 0,
                        "imageset": 0, **({"profile": 0} if profile else {})}],
        "imageset": [{"__id__": "ImageSet", "images": ["obs.cbf"], "mask": "", "gain": "", "pedestal": "", "dx": "",
                      "dy": "", "params": {}}],
        "beam": [{"direction": [0.0, 0.0, 1.0], "wavelength": 1.0, "divergence": 0.0, "sigma_divergence": 0.0,
                  "polarization_normal": [0.0, 1.0, 0.0], "polarization_fraction": 0.999, "flux": 0.0,
                  "transmission": 1.0}],
        "detector": [{"panels": [{"name": "Panel", "type": "SENSOR_PAD", "fast_axis": [1.0, 0.0, 0.0],
                                  "slow_axis": [0.0, -1.0, 0.0],
                                  "origin": [-half + 0.03 - shift_px[0] * PIXEL, half - 0.02 + shift_px[1] * PIXEL,
                                             -DISTANCE],
                                  "raw_image_offset": [0, 0], "image_size": [SIZE, SIZE], "pixel_size": [PIXEL, PIXEL],
                                  "trusted_range": [-1.0, 1e9], "thickness": 0.0, "material": "", "mu": 0.0,
                                  "identifier": "", "mask": [], "gain": 1.0, "pedestal": 0.0,
                                  "px_mm_strategy": {"type": "SimplePxMmStrategy"}}]}],
        "crystal": [crystal],
        "profile": [{"__id__": "gaussian_rs", "n_sigma": 3.0, "sigma_b": 0.15, "sigma_m": 0.0}] if profile else [],
    }


@pytest.fixture(scope="module")
def still(tmp_path_factory) -> Path:
    """truth.expt, start.expt (off as the module says), obs.cbf simulated from the truth (Poisson over 2 photons) and
    obs.refl: its spots found, flagged strong and indexed."""
    folder = tmp_path_factory.mktemp("dials_still")
    (folder / "truth.expt").write_text(json.dumps(still_document()))
    (folder / "start.expt").write_text(json.dumps(still_document(0.15, 1.005, (0.6, -0.5))))
    flags = " ".join(experiment_flags(read_expt(folder / "truth.expt")))
    img = simulate(f"{flags} {CRYSTAL}", scale=0.1, background=2.0)
    write_cbf(folder / "obs.cbf", img, {"pixel_size_mm": PIXEL})
    spots = find_spots(img.astype(float))
    n = len(spots)
    assert n >= 5 * 10  # enough for every default name (refine.quality.identifiability: 5 spots per name)
    write_refl(folder / "obs.refl", {"xyzobs.px.value": ("vec3<double>", np.c_[spots[:, :2], np.zeros(n)]),
                                     "miller_index": ("cctbx::miller::index<>", np.zeros((n, 3), dtype=np.int32)),
                                     "flags": ("std::size_t", np.full(n, (1 << 5) | (1 << 2), dtype=np.uint64)),
                                     "id": ("int", np.zeros(n, dtype=np.int32)),
                                     "panel": ("std::size_t", np.zeros(n, dtype=np.uint64))}, {0: "still"})
    return folder


def _copy(folder: Path, dest: Path, *names: str) -> None:
    for name in names or ("truth.expt", "start.expt", "obs.cbf", "obs.refl"):
        (dest / name).write_bytes((folder / name).read_bytes())


def _fitted(out: str) -> tuple[int, int]:
    match = re.search(r"fitting (\d+) of (\d+) pixels", out)
    assert match, out
    return int(match.group(1)), int(match.group(2))


def test_still_crystal_model_and_window_from_the_experiment(tmp_path):
    """The ML domain size over each cell length, the half mosaicity as the ball's spread (the Gaussian set's:
    the same rocking width), the profile's sigma_b as the window; without the ML values the size from sigma_b and
    no mosaic; a scan of zero width is a still."""
    (tmp_path / "s.expt").write_text(json.dumps(still_document()))
    exp = read_expt(tmp_path / "s.expt")
    m = still_model(exp)
    assert m.N == (10, 10, 7) and m.mosaic_deg == pytest.approx(0.3) and m.missing() == ()
    assert still_model(exp, "gaussian").mosaic_deg == pytest.approx(0.3 * 0.4964, rel=2e-3)
    px = math.radians(0.15) * DISTANCE / PIXEL  # sigma_b on the detector: 0.65 px (the spots' rms radius 0.69 px)
    assert window_half_px(exp, still=True)[0] == math.ceil(3 * px / math.sqrt(2)) == 2
    assert window_half_px(exp)[0] == math.ceil(3 * px) + 1 == 3  # a sweep's rule: DIALS's foreground and a pixel
    (tmp_path / "p.expt").write_text(json.dumps(still_document(crystal_model=False)))
    m = still_model(read_expt(tmp_path / "p.expt"))
    size = math.sqrt(1.5) / math.pi * 1.0 / math.radians(0.15)  # the lattice factor holding all of sigma_b (149 A)
    assert m.N == (round(size / 40), round(size / 40), round(size / 60)) and m.missing() == ("mosaic",)
    (tmp_path / "n.expt").write_text(json.dumps(still_document(crystal_model=False, profile=False)))
    assert window_half_px(read_expt(tmp_path / "n.expt"))[0] == 5
    from refine.cli.parser import parse_args
    from refine.inputs.still_defaults import dials_still

    doc = still_document()
    doc["experiment"][0]["scan"] = 0
    doc["scan"] = [{"image_range": [1, 1], "oscillation": [10.0, 0.0], "exposure_time": [0.1], "epochs": [0.0],
                    "batch_offset": 0, "valid_image_ranges": {}}]
    (tmp_path / "z.expt").write_text(json.dumps(doc))
    (tmp_path / "s.refl").write_bytes(b"")
    args = parse_args(["--image", "x.cbf", "--expt", str(tmp_path / "z.expt"), "--refl", str(tmp_path / "s.refl")])
    assert dials_still(args.dials_files, args.many.rotation_series)


def test_natural_command_prints_its_choices_and_fits_the_windows(refine_cli, still):
    """The choices in the run's first lines; the fitted pixels are the windows about the .refl spots and 2 % of the
    others (at most a quarter as many as the windows), not the image; the refined names are the default set.  (Two
    steps only: where the run ends is the slow test's.)"""
    _copy(still, Path.cwd())
    r = refine_cli("--image", "obs.cbf", "--expt", "start.expt", "--refl", "obs.refl", "--max-steps", "2", "--no-esds")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == "nbtorch-refine: a still from DIALS files (--expt start.expt, --refl obs.refl); defaults:"
    assert lines[1].startswith("  refine scale,background,orientation,cell,mosaic,beam_centre,distance in one stage")
    assert lines[2].startswith("  spot windows of +-2 pixels around the --refl spots (3 sigma along each axis, from "
                               "the profile's sigma_b 0.15 deg = 0.654 px")
    assert lines[3].startswith("  2 % of the pixels outside the windows, at most 0.25 per window pixel")
    assert "crystal model of the still from the DIALS experiment (ML_domain_size_ang 400 A; ML_half_mosaicity_deg " \
           "0.3): -Na 10 -Nb 10 -Nc 7 -mosaic 0.3 -default_F 100 -oversample 1" in r.out
    assert "distance fixed" not in r.out
    spots = r.json()["spots"]["observed"]
    windows = int(window_mask((SIZE, SIZE), np.asarray(spots)[:, :2], 2).sum())
    used, total = _fitted(r.out)
    rest = total - windows
    expected = min(0.02, 0.25 * windows / rest) * rest
    assert total == SIZE * SIZE and windows < total // 2
    assert abs(used - windows - expected) <= 4 * math.sqrt(expected) + 1, (used, windows, expected)
    assert f"{windows} pixels in their windows" in r.out
    assert set(r.json()["free"]) == EXPECTED_FREE


def test_the_dials_functions_take_typed_files_read_once(still, monkeypatch):
    """A Python caller's DialsFiles (no command-line options): the still's defaults, its spots and its model's flags,
    each file parsed once however many functions read it."""
    import functools

    import nbtorch.io.dials as dials_io
    from refine.inputs.dials import model_tokens, refl_spots, spot_window
    from refine.inputs.measurement import DialsFiles, Measurement
    from refine.inputs.still_defaults import REST_FRACTION, STILL_REFINE, still_defaults

    dials_io.forget_parsed()
    parses = []
    for name in ("_parse_json", "_parse_refl"):  # what parsing a file costs, counted
        real = getattr(dials_io, name)
        monkeypatch.setattr(dials_io, name, functools.wraps(real)(
            lambda path, real=real: parses.append(path) or real(path)))
    files = Measurement.from_dials(still / "start.expt", still / "obs.refl", image=still / "obs.cbf").dials_files
    assert files == DialsFiles(expt=str(still / "start.expt"), refl=str(still / "obs.refl"), image=str(still / "obs.cbf"))
    d = still_defaults(files)
    assert (d.refine, d.spot_window, d.subsample, d.rest_ratio is not None) == (STILL_REFINE, 2, REST_FRACTION, True)
    assert still_defaults(files, spot_window=4, choose_names=False).fields() == {"subsample": REST_FRACTION}
    assert still_defaults(files, rotation_series=True) is None
    assert len(refl_spots(files)) > 50 and spot_window(files, None) is None and spot_window(files, 3) == 3
    assert "-Na" in model_tokens(files, "-default_F 100") and model_tokens(None, "-N 5") == "-N 5"
    assert sorted(parses) == sorted([files.expt, files.refl])  # each file parsed once


def test_explicit_flags_win(refine_cli, still):
    """--refine, --spot-window, --subsample and --model replace the defaults, and only those lines are left out;
    --fix names leave the default set."""
    _copy(still, Path.cwd())
    r = refine_cli("--image", "obs.cbf", "--expt", "start.expt", "--refl", "obs.refl", "--refine",
                   "scale,background,orientation", "--spot-window", "2", "--subsample", "0.5", "--model", "-N 8",
                   "--max-steps", "1", "--no-esds")
    assert r.code == 0, r.err
    assert "defaults:" in r.out and "  refine " not in r.out and "spot windows of" not in r.out
    assert "% of the pixels outside the windows" not in r.out and "-Na 10" not in r.out and "-mosaic 0.3" in r.out
    assert set(r.json()["free"]) == {"scale", "background", "orient_x", "orient_y", "orient_z"}
    windows = int(window_mask((SIZE, SIZE), np.asarray(r.json()["spots"]["observed"])[:, :2], 2).sum())
    used, total = _fitted(r.out)
    assert abs(used - windows - 0.5 * (total - windows)) <= 4 * math.sqrt(0.25 * (total - windows)), (used, windows)
    r = refine_cli("--image", "obs.cbf", "--expt", "start.expt", "--refl", "obs.refl", "--fix", "distance,mosaic",
                   "--max-steps", "1", "--no-esds")
    assert r.code == 0, r.err
    assert "  refine scale,background,orientation,cell,beam_centre in one stage" in r.out
    assert set(r.json()["free"]) == EXPECTED_FREE - {"distance", "mosaic_spread", "N"}


def test_still_without_a_crystal_size_needs_the_model(refine_cli, still):
    """No ML values, no profile: one line naming --model, exit 2, nothing written; a size from --model and no
    spread anywhere: the model has none, and N is refined instead of the mosaic group."""
    _copy(still, Path.cwd(), "obs.cbf", "obs.refl")
    (Path.cwd() / "bare.expt").write_text(json.dumps(still_document(crystal_model=False, profile=False)))
    r = refine_cli("--image", "obs.cbf", "--expt", "bare.expt", "--refl", "obs.refl")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert "--model: the experiment (bare.expt) gives no crystal size of the still" in r.err
    assert not (Path.cwd() / "result.json").exists()
    r = refine_cli("--image", "obs.cbf", "--expt", "bare.expt", "--refl", "obs.refl", "--model", "-N 10",
                   "--max-steps", "1", "--no-esds")
    assert r.code == 0, r.err
    assert "  no mosaic spread (the experiment's crystal has no ML_half_mosaicity_deg)" in r.out
    assert "  refine scale,background,orientation,cell,N,beam_centre,distance in one stage" in r.out
    assert "spot windows of +-5 pixels around the --refl spots (the experiment has no profile" in r.out
    assert "mosaic_spread" not in r.json()["free"] and "N" in r.json()["free"]


@pytest.mark.slow
def test_natural_command_converges_to_the_truth(refine_cli, still):
    """The natural command alone (and --expt-out to read the crystal back): the cell, distance and beam centre within
    4 esds of the truth (0.5 % and 0.6 px off at the start), the crystal turned back to 0.02 deg of it (0.15 deg),
    the spots 0.2 px from the observed ones."""
    _copy(still, Path.cwd())
    r = refine_cli("--image", "obs.cbf", "--expt", "start.expt", "--refl", "obs.refl", "--expt-out", "refined.expt")
    assert r.code == 0, r.err
    result = r.json()
    assert result["status"] == "converged" and set(result["free"]) == EXPECTED_FREE
    p, e = result["params"], result["esds"]
    truth = {"cell_a": CELL[0], "cell_c": CELL[2], "distance": DISTANCE, "beam_x": SIZE * PIXEL / 2 - 0.03,
             "beam_y": SIZE * PIXEL / 2 - 0.02, "mosaic_spread": 0.3}
    for name, value in truth.items():
        assert abs(p[name] - value) < 4 * e[name] + 1e-3 * abs(value) * (name.startswith("cell")), (name, p[name], e[name])
    refined, true = read_expt(Path.cwd() / "refined.expt"), read_expt(Path.cwd() / "truth.expt")
    for key in ("real_space_a", "real_space_b", "real_space_c"):
        u, v = (np.asarray(x.crystal[key]) / np.linalg.norm(x.crystal[key]) for x in (refined, true))
        assert math.degrees(math.acos(min(1.0, float(u @ v)))) < 0.02, key
    spots = result["spots"]
    assert spots["rms_px_start_common"] > 0.5 and spots["rms_px_final_common"] < 0.2, spots["rms_px_final_common"]


def test_panel_groups_of_a_one_panel_detector_are_refused(refine_cli, still):
    """``--panel-groups`` names a level of a multi-panel detector's hierarchy; a one-panel ``--expt`` has only level 0,
    so any other level is one line naming the option, exit 2, nothing written (it was taken and ignored)."""
    _copy(still, Path.cwd(), "obs.cbf", "start.expt", "obs.refl")
    r = refine_cli("--image", "obs.cbf", "--expt", "start.expt", "--refl", "obs.refl", "--panel-groups", "7")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert "--panel-groups 7: the --expt detector has one panel, whose only level is 0" in r.err
    assert not (Path.cwd() / "result.json").exists() and not (Path.cwd() / "result.h5").exists()
