"""nbtorch-refine end to end on tiny problems: files, result.json keys, config files, resume, measured images."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from cli_helpers import CRYSTAL, simulate
from nbtorch.io import write_cbf
from nbtorch.parameters import PARAMETER_NAMES

TINY = ("--problem", "tetragonal_mosflm", "--size", "32")
REQUIRED = ("params", "esds", "initial_params", "loss_initial", "loss_final", "steps", "status", "wall_s")


def test_problem_run_writes_result_files(refine_cli):
    r = refine_cli(*TINY, "--refine", "scale,background,cell,beam_x,beam_y", "--max-steps", "4",
                   "--out", "res.h5", "--logdir", "runs/tiny")
    assert r.code == 0, r.err
    doc = r.json("res.json")
    for key in REQUIRED:
        assert key in doc, key
    for name in PARAMETER_NAMES:  # every canonical parameter, fixed ones too
        assert isinstance(doc["params"][name], float), name
        assert isinstance(doc["initial_params"][name], float), name
    assert {"N_a", "N_b", "N_c"} <= set(doc["params"])
    assert doc["status"] in ("converged", "max_steps")
    assert 0 < doc["steps"] <= 4 and doc["wall_s"] > 0
    assert doc["loss_final"] < doc["loss_initial"]
    assert set(doc["esds"]) >= {"cell_a", "cell_c", "beam_x", "beam_y", "scale", "background"}
    assert doc["truth"]["cell_a"] == 46.0 and doc["input"]["problem"] == "tetragonal_mosflm"
    with h5py.File(r.tmp / "res.h5", "r") as h5:
        assert h5.attrs["status"] == doc["status"]
        assert h5["images/observed"].shape == (32, 32)
        assert float(h5["truth/cell_a"][()]) == 46.0
        assert set(h5["params"]) >= set(PARAMETER_NAMES)
    assert any(p.name.startswith("events.out.tfevents") for p in (r.tmp / "runs" / "tiny").rglob("*"))
    # the table shows truth, start, refined and esd side by side, and says where the logs are
    assert "truth" in r.out and "refined" in r.out and "esd" in r.out
    assert "cell_a" in r.out and "TensorBoard logs:" in r.out and "runs/tiny" in r.out
    # and how the fit compares with shot noise (4 steps from a perturbed start: not at the noise level yet)
    assert "the shot-noise expectation" in r.out
    assert doc["fit"]["pixels"] > 0 and doc["fit"]["excess"] == pytest.approx(doc["fit"]["loss"] / doc["fit"]["expected_loss"])
    assert isinstance(doc["warnings"], list)


def test_esd_extra_reports_fixed_parameter_correlations(refine_cli):
    r = refine_cli(*TINY, "--refine", "scale,background,cell", "--max-steps", "3", "--esd-extra", "distance")
    assert r.code == 0, r.err
    extra = r.json()["esd_extra"]
    names = extra["names"]
    assert "distance" in names and "cell_a" in names
    corr = np.asarray(extra["correlation"])
    assert corr.shape == (len(names), len(names))
    np.testing.assert_allclose(np.diag(corr), 1.0)
    assert extra["esds"]["distance"] > 0
    assert "distance (fixed) esd if refined" in r.out and "esds with distance refined as well" in r.out


def test_quiet_prints_nothing(refine_cli):
    r = refine_cli(*TINY, "--refine", "scale,background", "--max-steps", "2", "--quiet", "--no-esds")
    assert r.code == 0, r.err
    assert r.out == "" and r.err == ""
    assert (r.tmp / "result.h5").is_file() and (r.tmp / "result.json").is_file()


def test_missing_output_directories_are_created(refine_cli):
    r = refine_cli(*TINY, "--refine", "scale,background", "--max-steps", "1", "--quiet", "--no-esds",
                   "--out", "new/run/r.h5", "--logdir", "new/tb")
    assert r.code == 0, r.err
    assert (r.tmp / "new/run/r.h5").is_file() and (r.tmp / "new/run/r.json").is_file()
    assert any((r.tmp / "new/tb").iterdir())


def test_config_file_and_command_line_override(refine_cli, tmp_path):
    (tmp_path / "run.toml").write_text(
        'problem = "tetragonal_mosflm"\nsize = 32\nrefine = ["scale", "background"]\nmax_steps = 7\n'
        'quiet = true\nno_esds = true\njson = "from_config.json"\n')
    r = refine_cli("--config", "run.toml", "--max-steps", "1")
    assert r.code == 0, r.err
    doc = r.json("from_config.json")
    assert doc["steps"] == 1 and doc["free"] == ["scale", "background"]


def test_config_stage_tables(refine_cli, tmp_path):
    (tmp_path / "stages.toml").write_text(
        'problem = "tetragonal_mosflm"\nsize = 32\nquiet = true\nno_esds = true\n'
        '[[stages]]\nname = "coarse"\nfree = ["scale", "background", "beam_centre"]\nbin = 4\nmax_steps = 2\n'
        '[[stages]]\nname = "fine"\nfree = "scale,background,beam_centre,cell"\nmax_steps = 2\n')
    r = refine_cli("--config", "stages.toml")
    assert r.code == 0, r.err
    doc = r.json()
    assert [s["name"] for s in doc["stages"]] == ["coarse", "fine"]
    assert doc["stages"][0]["settings"]["bin"] == 4


def test_resume_continues_from_the_checkpoint(refine_cli):
    args = (*TINY, "--refine", "scale,background,beam_centre", "--max-steps", "3", "--checkpoint-every", "1",
            "--quiet", "--no-esds")
    first = refine_cli(*args)
    assert first.code == 0, first.err
    assert (first.tmp / "result.ckpt.h5").is_file()
    a = first.json()
    again = refine_cli(*args, "--resume")
    assert again.code == 0, again.err
    b = again.json()
    assert b["steps"] == a["steps"]
    for name in ("beam_x", "beam_y", "scale", "background"):
        assert b["params"][name] == pytest.approx(a["params"][name], rel=1e-12, abs=1e-12)
    other = refine_cli(*TINY, "--refine", "scale,background", "--max-steps", "3", "--quiet", "--resume")
    assert other.code == 2 and "another problem or plan" in other.err


def test_measured_cbf_with_header_geometry(refine_cli, tmp_path):
    """A measured image (CBF with Pilatus header) and a model that leaves the geometry to the header."""
    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 32 -Xbeam 1.63 -Ybeam 1.58"
    img = simulate(f"{CRYSTAL} -cell 30.3 30.3 40 90 90 90 {geometry}".replace("-cell 30 30 40 90 90 90 ", ""))
    img[:, 10] = -1  # a module gap
    write_cbf(tmp_path / "obs.cbf", img, {"wavelength_A": 1.0, "distance_mm": 40.0, "pixel_size_mm": 0.1,
                                          "beam_x_px": (1.58 + 0.05) / 0.1, "beam_y_px": (1.63 + 0.05) / 0.1,
                                          "count_cutoff": 10**6})
    r = refine_cli("--image", "obs.cbf", "--model", CRYSTAL, "--symmetry", "P41212",
                   "--refine", "scale,background,cell", "--max-steps", "6", "--subsample", "0.9",
                   "--dmin", "1.5")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["input"]["geometry"]["distance_mm"] == 40.0
    assert doc["input"]["masked"] == {"negative": 32}
    assert "-distance" in doc["input"]["model"] and "-Xbeam" in doc["input"]["model"]
    assert doc["params"]["cell_b"] == doc["params"]["cell_a"]  # tetragonal
    assert doc["params"]["distance"] == 40.0 and doc["params"]["beam_x"] == pytest.approx(1.63)
    with h5py.File(r.tmp / "result.h5", "r") as h5:
        used = h5["images/mask"][()].astype(bool)
    assert not used[:, 10].any() and used.sum() < 0.9 * 32 * 31 * 1.05
    assert "distance 40 mm from the header" in r.out


def test_spots_report(refine_cli, tmp_path):
    """--spots find: rms spot offsets before and after, in the output and the json."""
    crystal = "-cell 30 30 40 90 90 90 -misset 10 20 30 -N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48"
    img = simulate(f"{crystal} {geometry} -Xbeam 2.45 -Ybeam 2.45", background=1.0)
    write_cbf(tmp_path / "obs.cbf", img, {"pixel_size_mm": 0.1})
    r = refine_cli("--image", "obs.cbf", "--model", f"{crystal} {geometry} -Xbeam 2.5 -Ybeam 2.4",
                   "--refine", "scale,background,beam_centre", "--max-steps", "10", "--spots", "find",
                   "--spot-window", "3", "--subsample", "0.2", "--no-esds")
    assert r.code == 0, r.err
    s = r.json()["spots"]
    assert s["n"] >= 10 and s["n_common"] >= 5
    assert s["rms_px_final_common"] < s["rms_px_start_common"]
    assert len(s["observed"]) == s["n"] and len(s["predicted_final"]) == s["n"]
    assert "rms offset" in r.out
    # the noise floor: Poisson draws of the refined model (seeded by --seed), the same finder as --spots find
    assert s["floor_realisations"] == 5 and s["floor_seed"] == 0 and 0 < s["floor_spots"] <= s["matched_final"]
    assert 0 < s["rms_px_floor"] < s["rms_px_final"] and s["rms_px_procedure"] >= 0 and s["floor_found"] > 0.5
    assert f"noise floor {s['rms_px_floor']:.3g} px" in r.out
    # what the model misses (refine.quality.misfit): sigZ beside the fit excess, the spot profile, the background
    diag = r.json()["diagnostics"]
    assert diag["profile"]["spots"] > 0 and diag["background_by_resolution"]["pixels"] > 0
    assert f"misfit: sigZ {diag['sigZ']:.3g} (robust" in r.out
    assert f"spot profile ({diag['profile']['spots']} spots)" in r.out and "background between spots" in r.out


@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_max_steps_gives_stage_a_final_stage_five_times(optimizer):
    from refine.cli.parser import parse_args
    from refine.modes.values import build_stages

    stages = build_stages(parse_args(["--problem", "cubic_mosflm", "--max-steps", "10", "--optimizer", optimizer]))
    assert [s.name for s in stages][-1] == "final"
    assert [s.convergence.max_steps for s in stages] == [10] * (len(stages) - 1) + [50]


def test_history_size_and_precondition_reach_every_stage():
    from refine.cli.parser import parse_args
    from refine.modes.values import build_stages

    stages = build_stages(parse_args(["--problem", "cubic_mosflm", "--history-size", "7",
                                      "--precondition", "diagonal"]))
    assert len(stages) > 1
    assert {s.strategy.history_size for s in stages} == {7} and {s.precondition for s in stages} == {"diagonal"}
    stages = build_stages(parse_args(["--problem", "cubic_mosflm", "--refine", "cell", "--precondition", "none"]))
    assert [s.precondition for s in stages] == [None]


def test_stage_table_precondition(tmp_path):
    from refine.cli.parser import parse_args
    from refine.modes.values import build_stages

    (tmp_path / "s.toml").write_text('problem = "cubic_mosflm"\n[[stages]]\nfree = ["cell"]\nprecondition = "full"\n'
                                     'history_size = 5\n[[stages]]\nfree = ["cell", "scale"]\n')
    stages = build_stages(parse_args(["--config", str(tmp_path / "s.toml")]))
    assert [s.precondition for s in stages] == ["full", None]
    assert [s.strategy.history_size for s in stages] == [5, 20]


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "adam", "--history-size", "5"], "--history-size: only for --optimizer lbfgs"),
    (["--history-size", "0"], "--history-size: must be >= 1"),
])
def test_bad_optimizer_options(argv, message):
    from nbtorch.errors import InputError
    from refine.cli.parser import parse_args
    from refine.modes.values import build_stages

    with pytest.raises(InputError, match=message):
        build_stages(parse_args(["--problem", "cubic_mosflm", *argv]))


def test_spot_list_with_named_columns(refine_cli, tmp_path):
    """--spots with a DIALS-style table: x and y named by --spot-columns (the header-less table alone is refused)."""
    from refine.inputs.spots import find_spots

    crystal = "-cell 30 30 40 90 90 90 -misset 10 20 30 -N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48 -Xbeam 2.45 -Ybeam 2.45"
    img = simulate(f"{crystal} {geometry}", background=1.0)
    write_cbf(tmp_path / "obs.cbf", img, {"pixel_size_mm": 0.1})
    found = find_spots(img.astype(float))
    assert len(found) >= 5
    (tmp_path / "refl.txt").write_text("".join(f"0 0 1 100.0 {x:.3f} {y:.3f} 0.5\n" for x, y in found))
    common = ("--image", "obs.cbf", "--model", f"{crystal} {geometry}", "--refine", "scale,background",
              "--max-steps", "2", "--spots", "refl.txt", "--no-esds")
    r = refine_cli(*common)
    assert r.code == 2 and "7 columns and no header naming them" in r.err
    r = refine_cli(*common, "--spot-columns", "5,6")
    assert r.code == 0, r.err
    np.testing.assert_allclose(r.json()["spots"]["observed"], np.round(found, 3))


def test_config_value_starting_with_a_dash(tmp_path):
    """A config value that starts with '-' (a one-flag model) is the option's value, not another option."""
    from refine.cli.parser import parse_args

    (tmp_path / "run.toml").write_text('image = "x.cbf"\nmodel = "-mosflm"\nstart = { cell_a = -1 }\n')
    args = parse_args(["--config", str(tmp_path / "run.toml")])
    assert args.model.model == "-mosflm" and args.fit.start == ("cell_a=-1",)


def test_measured_image_default_plan_refines_the_tilt_and_fixes_the_distance(refine_cli, tmp_path):
    """With --image and no --refine/--stages: stage_a whose detector stage frees the tilt; the distance is fixed
    unless --fix says otherwise (--fix none: nothing fixed)."""
    from refine.cli.parser import parse_args
    from refine.modes.values import build_stages

    stages = build_stages(parse_args(["--image", "obs.cbf", "--model", CRYSTAL]))
    detector = next(s for s in stages if s.name == "detector")
    assert set(detector.free) >= {"distance", "detector_rotx", "detector_roty"}
    assert build_stages(parse_args(["--problem", "tetragonal_mosflm"])) is None  # synthetic problems: the core's
    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 32 -Xbeam 1.63 -Ybeam 1.58"
    write_cbf(tmp_path / "obs.cbf", simulate(f"{CRYSTAL} {geometry}"), {"wavelength_A": 1.0, "distance_mm": 40.0,
                                                                       "pixel_size_mm": 0.1})
    r = refine_cli("--image", "obs.cbf", "--model", f"{CRYSTAL} {geometry}", "--max-steps", "1", "--no-esds",
                   "--too-few-spots", "warn")
    assert r.code in (0, 1), r.err
    assert "distance fixed (one image" in r.out
    free = r.json()["free"]
    assert "distance" not in free and {"detector_rotx", "detector_roty"} <= set(free)
    r = refine_cli("--image", "obs.cbf", "--model", f"{CRYSTAL} {geometry}", "--max-steps", "1", "--no-esds",
                   "--too-few-spots", "warn", "--fix", "none", "--out", "all.h5")
    assert "distance" in r.json("all.json")["free"] and "distance fixed" not in r.out


def test_refining_the_anisotropic_mosaic(refine_cli):
    """``--refine mosaic_aniso`` turns the model's mosaic anisotropic (three spreads starting at the isotropic
    one: the same starting image) and writes the three spreads, their units and esds to result.json."""
    r = refine_cli(*TINY, "--refine", "scale,mosaic_aniso", "--max-steps", "3", "--out", "res.h5")
    assert r.code == 0, r.err
    doc = r.json("res.json")
    axes = ("mosaic_spread_a", "mosaic_spread_b", "mosaic_spread_c")
    assert set(axes) <= set(doc["free"]) and "mosaic_spread" not in doc["free"]
    start = doc["initial_params"]["mosaic_spread"]
    assert all(doc["initial_params"][n] == start for n in axes)
    assert all(doc["units"][n] == "deg" and doc["params"][n] > 0 and n in doc["esds"] for n in axes)
    assert doc["loss_final"] <= doc["loss_initial"]



@pytest.mark.parametrize("model, message", [
    ("-mosaic_model sphere", "-mosaic_model: unknown model 'sphere'"),
    ("-mosaic_dom 0", "-mosaic_dom: the ball mosaic set is built with 1 to 100000 domains"),
    ("-mosaic_model gaussian -mosaic_seed 3", "-mosaic_seed: the gaussian mosaic set is even")])
def test_bad_mosaic_settings_are_refused_at_the_door(refine_cli, tmp_path, model, message):
    """A measured image's starting model with a bad mosaic setting: one line, exit 2, nothing written."""
    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 32 -Xbeam 1.63 -Ybeam 1.58"
    write_cbf(tmp_path / "obs.cbf", np.full((32, 32), 5, dtype=np.int32), {"wavelength_A": 1.0, "distance_mm": 40.0,
                                                             "pixel_size_mm": 0.1, "count_cutoff": 10**6})
    crystal = CRYSTAL.replace("-mosaic_dom 2 ", "")
    r = refine_cli("--image", "obs.cbf", "--model", f"{crystal} {geometry} {model}", "--out", "out/res.h5")
    assert r.code == 2 and message in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert not (tmp_path / "out").exists()
