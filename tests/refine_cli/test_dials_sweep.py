"""Rotation sweeps from DIALS, end to end (issue #34; docs/sweep-from-dials.md).

* a multi-axis goniometer reduces exactly to one spindle: against hand-made fixed and setting rotations, and on the
  real L-cysteine sweep against DIALS's own predictions (skipped where the data are absent);
* a synthetic sweep made here: a ``.expt`` with a multi-axis goniometer and a non-zero fixed rotation, three small
  simulated 0.5 deg images named by its template (no angle in their headers), their ``.refl`` (indexed from the
  document's axes by hand): each image's angle
  from the scan, its spots from the ``.refl`` rows on it, the joint fit converging to the truth, the per-image
  reports, ``--expt-out`` and the refusals of images that do not match the experiment;
* the starting crystal model of a DIALS profile;
* the default schedule of a single run with spot windows far from the beam (the issue's crash);
* the real sweep (``-m slow``): the issue's command, from DIALS's model and from a start 1 % off in the cell and
  0.3 deg in orientation.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import simulate
from experiments.wedge_calibration import one_panel_sweep, rotation, sphere_crossings
from nbtorch.dials.geometry import bragg_positions_px, experiment_flags, goniometer_rotations
from nbtorch.io import write_cbf
from nbtorch.io.dials import read_expt, read_refl, write_refl
from refine.modes.joint import _held_geometry
from refine.cli.parser import parse_args
from refine.fitting.parameters import ParameterSpace
from refine.modes.single import amplitude_group, amplitude_options
from refine.inputs.start_model import ROTATION_MOSAIC_DOMAINS
from refine.inputs.dials import profile_model
from refine.many.image_reports import model_warning

REAL = Path("/work/shared/real/lcysteine_i19_sweep2")
#: the synthetic sweep: a tetragonal crystal turning about omega with phi held at 30 deg about a tilted axis
CELL, DISTANCE = (80.0, 80.0, 100.0), 25.0
#: the panel's centre 6.7 mm off the beam along DIALS x (2 theta about 15 deg: reflections cross the sphere there)
OFFSET = 6.7
AXES, ANGLES = [[0.5774, -0.8165, 0.0], [1.0, 0.0, 0.0]], [30.0, 10.0]
START, WIDTH, N_IMAGES, SIZE = 10.0, 0.5, 3, 48
CRYSTAL = "-N 2 -default_F 100 -mosaic 0.2 -mosaic_dom 4 -oversample 1 -phisteps 5"


def sweep_document(axes=AXES, angles=ANGLES, scan_axis=1) -> dict:
    """A DIALS ExperimentList (dxtbx's layout) of the synthetic sweep: a 48 x 48 panel of 0.1 mm normal to the beam at
    25 mm, its centre 15 deg off the beam, the multi-axis goniometer, images 1..3 of template ``sweep_#####.cbf``
    from 10 deg in 0.5 deg steps."""
    u = rotation([1, 2, 3], 40.0)
    real = (u @ np.diag(CELL)).T  # rows a, b, c
    half = SIZE * 0.1 / 2
    return {
        **one_panel_sweep("synthetic", "sweep_#####.cbf", SIZE, 0.1, [OFFSET - half, half - 0.05, -DISTANCE],
                          profile=True),
        "goniometer": [{"axes": axes, "angles": angles, "names": ["GON_PHI", "GON_OMEGA"][:len(axes)],
                        "scan_axis": scan_axis}],
        "scan": [{"image_range": [1, N_IMAGES], "batch_offset": 0, "oscillation": [START, WIDTH],
                  "exposure_time": [0.1] * N_IMAGES, "epochs": [0.0] * N_IMAGES, "valid_image_ranges": {}}],
        "crystal": [{"__id__": "crystal", "real_space_a": list(real[0]), "real_space_b": list(real[1]),
                     "real_space_c": list(real[2]), "space_group_hall_symbol": " P 4 2"}],
        "profile": [{"__id__": "gaussian_rs", "n_sigma": 3.0, "sigma_b": 0.15, "sigma_m": 0.2}],
    }


def test_multi_axis_goniometer_is_one_spindle_with_fixed_and_setting_rotations(tmp_path):
    """Axes [phi, omega, kappa-like], scanning omega: the axes below it are the fixed rotation, those above the
    setting rotation (dxtbx's MultiAxisGoniometer), and the flags equal those of a single-axis goniometer with those
    matrices; two scan axes are refused in one line."""
    axes, angles = [[0.5774, -0.8165, 0.0], [1.0, 0.0, 0.0], [0.0, 0.6, 0.8]], [30.0, 10.0, -20.0]
    multi = sweep_document(axes, angles)
    fixed, setting, axis = goniometer_rotations(multi["goniometer"][0])
    assert np.allclose(fixed, rotation(axes[0], 30.0), atol=1e-12)
    assert np.allclose(setting, rotation(axes[2], -20.0), atol=1e-12) and np.allclose(axis, [1, 0, 0])
    single = sweep_document()
    single["goniometer"] = [{"rotation_axis": [1.0, 0.0, 0.0], "fixed_rotation": list(fixed.ravel()),
                             "setting_rotation": list(setting.ravel())}]
    for doc, name in ((multi, "multi.expt"), (single, "single.expt")):
        (tmp_path / name).write_text(json.dumps(doc))
    for k in range(N_IMAGES):
        assert experiment_flags(read_expt(tmp_path / "multi.expt"), k) == experiment_flags(
            read_expt(tmp_path / "single.expt"), k)
    flags = experiment_flags(read_expt(tmp_path / "multi.expt"), 2)
    assert flags[flags.index("-phi") + 1] == repr(START + 2 * WIDTH)
    multi["goniometer"][0]["scan_axis"] = [0, 1]
    (tmp_path / "two.expt").write_text(json.dumps(multi))
    with pytest.raises(Exception, match="more than one moving axis"):
        read_expt(tmp_path / "two.expt")


@pytest.mark.skipif(not (REAL / "23_integrated.expt").is_file(), reason="the real L-cysteine sweep is not here")
def test_real_multi_axis_sweep_predicts_dials_positions():
    """The real sweep's multi-axis model (phi held at 120 deg about a tilted axis, omega scanned) puts the strong
    reflections where DIALS predicts them (xyzcal.px, at their own angles): the reduction is DIALS's."""
    from nbtorch import Simulator, config_from_args

    exp = read_expt(REAL / "23_integrated.expt")
    sim = Simulator(config_from_args(experiment_flags(exp) + ["-N", "5", "-default_F", "1"]), compile=False)
    cols = read_refl(REAL / "23_integrated.refl", ("xyzcal.px", "miller_index", "flags"))
    strong = (cols["flags"] & (1 << 5)) > 0
    cal, hkl = cols["xyzcal.px"][strong], cols["miller_index"][strong]
    pred = bragg_positions_px(sim, {k: float(v) for k, v in sim.setup.params.items()}, hkl, -145.0 + 0.1 * cal[:, 2])
    rms = float(np.sqrt(((pred - cal[:, :2]) ** 2).sum(axis=1).mean()))
    assert len(cal) >= 15 and rms < 0.4, rms  # 0.23 px: DIALS' px also carry its parallax correction


def test_profile_model_from_sigma_b_and_sigma_m(tmp_path):
    (tmp_path / "s.expt").write_text(json.dumps(sweep_document()))
    m = profile_model(read_expt(tmp_path / "s.expt"), dstar=0.5, osc_deg=0.1)
    # sigma_q = min(sigma_b / lambda, sigma_m d* / sqrt 2) = 1.23e-3 1/A: domains of 316 A, 4 x 4 x 3 cells of 80 x 80 x 100
    assert m.domain_A == pytest.approx(math.sqrt(1.5) / math.pi / (math.radians(0.2) * 0.5 / math.sqrt(2)), rel=1e-9)
    # the C's law's spread (the default even set and the random draw) is about twice the mosaic's rocking sigma; the
    # Gaussian set's is that sigma itself
    eta_deg = math.degrees(math.radians(0.2) / math.sqrt(2))
    assert m.N == (4, 4, 3) and m.mosaic_model == "ball" and m.mosaic_deg == pytest.approx(eta_deg / 0.4964, rel=1e-3)
    assert m.domains == ROTATION_MOSAIC_DOMAINS and m.phisteps >= 5
    r = profile_model(read_expt(tmp_path / "s.expt"), dstar=0.5, osc_deg=0.1, mosaic_model="random")
    assert r.mosaic_deg == pytest.approx(m.mosaic_deg, rel=1e-12) and 30 <= r.domains <= 40
    g = profile_model(read_expt(tmp_path / "s.expt"), dstar=0.5, osc_deg=0.1, mosaic_model="gaussian")
    assert g.mosaic_deg == pytest.approx(eta_deg, rel=1e-9) and (g.N, g.phisteps) == (r.N, r.phisteps) == (m.N, m.phisteps)


def _reflections(doc: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(hkl, xyz)``: the reflections that cross the Ewald sphere during the scan and hit the panel, at their crossing
    (x, y pixels; z frames), from the document alone in the DIALS frame, with the fixed rotation made by hand: an
    ideal ``.refl`` of indexed spots, independent of nbtorch's reduction of the goniometer."""
    return sphere_crossings(doc, AXES[1], START, WIDTH, N_IMAGES, fixed=rotation(AXES[0], ANGLES[0]),
                            dstar=(0.15, 0.4), max_index=30)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """truth.expt, three images sweep_00001..3.cbf simulated from it (Poisson noise over 2 photons; no angle in the
    headers), sweep.refl (the reflections crossing the sphere in the scan, at their predicted centroids)."""
    folder = tmp_path_factory.mktemp("dials_sweep")
    (folder / "truth.expt").write_text(json.dumps(sweep_document()))
    exp = read_expt(folder / "truth.expt")
    for k in range(N_IMAGES):
        img = simulate(" ".join(experiment_flags(exp, k)) + f" {CRYSTAL}", scale=20.0, background=2.0, seed=40 + k)
        write_cbf(folder / f"sweep_{k + 1:05d}.cbf", img, {"pixel_size_mm": 0.1})
    hkl, xyz = _reflections(sweep_document())
    n = len(xyz)
    bbox = np.c_[np.floor(xyz[:, 0]) - 3, np.floor(xyz[:, 0]) + 4, np.floor(xyz[:, 1]) - 3, np.floor(xyz[:, 1]) + 4,
                 np.floor(xyz[:, 2]) - 1, np.floor(xyz[:, 2]) + 2].astype(np.int32)
    write_refl(folder / "sweep.refl", {"xyzobs.px.value": ("vec3<double>", xyz), "bbox": ("int6", bbox),
                                       "xyzcal.px": ("vec3<double>", xyz), "miller_index": ("cctbx::miller::index<>", hkl),
                                       "flags": ("std::size_t", np.full(n, 1 << 5, dtype=np.uint64)),
                                       "id": ("int", np.zeros(n, dtype=np.int32))}, {0: "synthetic"})
    return folder, [int((np.floor(xyz[:, 2]) == k).sum()) for k in range(N_IMAGES)]


def test_sweep_from_dials_files_refines_to_the_truth(refine_cli, sweep):
    folder, spots_per_image = sweep
    r = refine_cli("--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
                   str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--start",
                   "cell_a=80.24,cell_c=100.3", "--max-steps", "40", "--no-esds", "--out-dir", "sweep",
                   "--expt-out", "refined.expt", "--shared", "cell,orientation",  # the truth's geometry held
                   "--mtz-out", "sweep.mtz")
    assert r.code == 0, r.err
    assert "symmetry tetragonal from the experiment's space group" in r.out
    # the shared names are the joint run's, decided by all images, not a single image's default schedule
    assert "distance fixed" not in r.out
    assert "shared: cell, orientation (decided by all images)" in r.out
    # a sweep from DIALS files refines one amplitude per unique reflection in the experiment's space group
    assert "structure factors: one amplitude per unique reflection in P 4 2 2" in r.out
    assert "a plane held" not in r.out  # --background auto: a joint run keeps the flat background per image
    doc = json.loads((r.tmp / "sweep" / "joint.json").read_text())
    assert doc["status"] == "converged", doc["message"]
    assert doc["structure_factors"]["space_group"] == "P 4 2 2" and (r.tmp / "sweep" / "joint.hkl").is_file()
    for k, image in enumerate(doc["images"]):  # the scan's angle (the headers have none), the .refl's spots
        assert image["params"]["phi0"] == pytest.approx(START + k * WIDTH, abs=1e-9)
        assert image["spots"]["n"] == spots_per_image[k]
        assert image["fit"]["excess"] < 2.0
    shared = doc["shared"]  # started 0.3 % long
    assert abs(shared["cell_a"] / CELL[0] - 1) < 1e-3 and abs(shared["cell_c"] / CELL[2] - 1) < 2.5e-3, shared
    spots = doc["spots"]
    assert spots["n"] == sum(spots_per_image) and spots["rms_px_final_common"] < 0.6  # the centroids' own noise
    assert doc["fit"]["excess"] < 1.5
    assert "spots: rms" in r.out and "sweep_00002.cbf: phi 10.5 deg" in r.out
    out = read_expt(r.tmp / "refined.expt")  # the document DIALS wrote, the multi-axis goniometer kept
    assert out.goniometer == read_expt(folder / "truth.expt").goniometer and out.scan["image_range"] == [1, N_IMAGES]
    lengths = [np.linalg.norm(out.crystal[k]) for k in ("real_space_a", "real_space_b", "real_space_c")]
    assert lengths == pytest.approx([shared["cell_a"], shared["cell_b"], shared["cell_c"]], rel=1e-9)
    import gemmi  # the amplitudes as MTZ: the sweep's space group and refined cell, NOBS the images of each

    mtz = gemmi.read_mtz_file(str(r.tmp / "sweep.mtz"))
    nobs = np.array(mtz, copy=False)[:, mtz.column_labels().index("NOBS")]
    assert mtz.spacegroup.hm == "P 4 2 2" and len(nobs) == doc["structure_factors"]["n_free"] > 0
    assert mtz.cell.a == pytest.approx(shared["cell_a"], rel=1e-6) and mtz.cell.c == pytest.approx(shared["cell_c"], rel=1e-6)
    assert set(nobs) <= {1, 2, 3} and nobs.max() >= 2  # a reflection spread over the images of its rotation


def test_dialss_geometry_is_refined_with_a_prior_from_its_spots(refine_cli, sweep):
    """By default the distance and beam centre are refined with a Gaussian prior centred on DIALS's values, as wide as
    the esd the .refl's indexed spots give each (refine.inputs.geometry_prior; this .refl's centroids are exact, so the
    scatter is the floor, 0.1 px and frame): printed, written to joint.json, and the cell's esds carry it."""
    folder, _ = sweep
    r = refine_cli("--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
                   str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--start",
                   "cell_a=80.24,cell_c=100.3", "--max-steps", "80", "--out-dir", "prior")
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if "DIALS's geometry as a prior" in x)
    assert "the esds its 18 indexed spots give it" in line and "distance 25 +-" in line, line
    assert "shared: cell, orientation, distance, beam_centre (decided by all images)" in r.out
    doc = json.loads((r.tmp / "prior" / "joint.json").read_text())
    assert doc["status"] == "converged", doc["message"]
    priors, shared, esds = doc["priors"], doc["shared"], doc["shared_esds"]
    assert set(priors) == {"distance", "beam_x", "beam_y"} and priors["distance"]["mean"] == pytest.approx(DISTANCE)
    for name in priors:  # the posterior is narrower than the prior alone
        assert 0 < esds[name] <= priors[name]["sigma"] * 1.0001, (name, esds[name], priors[name])
    for name, truth in (("cell_a", CELL[0]), ("cell_c", CELL[2]), ("distance", DISTANCE)):
        assert abs(shared[name] - truth) < 3 * esds[name], (name, shared[name], esds[name])


def test_the_geometry_held_freed_or_restrained_by_the_users_prior(refine_cli, sweep, tmp_path):
    """--shared cell,orientation holds DIALS's geometry; --geometry-prior none refines it without a prior; --prior
    replaces one name's prior; a --prior on a name that is not shared is refused in one line, nothing written."""
    folder, _ = sweep
    base = ["--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
            str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--max-steps", "2", "--no-esds"]
    held = refine_cli(*base, "--shared", "cell,orientation", "--out-dir", "held")
    assert held.code == 0, held.err
    assert "geometry as a prior" not in held.out and "every other parameter (distance, beam, detector) held" in held.out
    assert "priors" not in json.loads((held.tmp / "held" / "joint.json").read_text())
    free = refine_cli(*base, "--geometry-prior", "none", "--out-dir", "free")
    assert free.code == 0, free.err
    assert "geometry as a prior" not in free.out and "shared: cell, orientation, distance, beam_centre" in free.out
    assert "priors" not in json.loads((free.tmp / "free" / "joint.json").read_text())
    mine = refine_cli(*base, "--prior", "distance=25.01:0.02", "--out-dir", "mine")
    assert mine.code == 0, mine.err
    priors = json.loads((mine.tmp / "mine" / "joint.json").read_text())["priors"]
    assert priors["distance"] == {"mean": 25.01, "sigma": 0.02} and set(priors) == {"distance", "beam_x", "beam_y"}
    bad = refine_cli(*base, "--prior", "scale=1:0.1", "--out-dir", "bad")
    assert bad.code == 2 and "--prior: scale not among the shared names" in bad.err
    assert len(bad.err.strip().splitlines()) == 1 and not (bad.tmp / "bad").exists()


def test_no_structure_factors_keeps_one_amplitude_for_every_reflection(refine_cli, sweep):
    """``--no-structure-factors`` turns the sweep's default amplitudes off: no amplitude table, no .hkl; DIALS's geometry
    is still refined with its prior."""
    folder, _ = sweep
    r = refine_cli("--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
                   str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--no-structure-factors",
                   "--max-steps", "2", "--no-esds", "--out-dir", "one_f")
    assert r.code == 0, r.err
    assert "structure factors:" not in r.out and not (r.tmp / "one_f" / "joint.hkl").exists()
    assert json.loads((r.tmp / "one_f" / "joint.json").read_text()).get("structure_factors") is None
    # the geometry's prior does not depend on the amplitudes
    assert "DIALS's geometry as a prior" in r.out and "every other parameter (detector) held" in r.out


def test_the_amplitudes_space_group_comes_from_the_experiment_unless_given(sweep):
    """--structure-factors without --space-group takes the --expt crystal's space group (P 4 2 2 here); a given
    --space-group or space-group --symmetry wins; without --expt a group must be named."""
    folder, _ = sweep
    expt = ["--image", str(folder / "sweep_00001.cbf"), "--expt", str(folder / "truth.expt")]
    assert amplitude_group(parse_args(expt)) == "P 4 2 2"
    assert amplitude_options(parse_args([*expt, "--structure-factors"])).space_group == "P 4 2 2"
    assert amplitude_group(parse_args([*expt, "--space-group", "P41212"])) == "P41212"
    assert amplitude_group(parse_args([*expt, "--symmetry", "P43212"])) == "P43212"
    assert amplitude_group(parse_args([*expt, "--symmetry", "tetragonal"])) == "P 4 2 2"
    assert amplitude_options(parse_args(expt)) is None  # a single run: off unless asked for
    assert amplitude_group(parse_args(["--image", str(folder / "sweep_00001.cbf")])) is None


def test_the_joint_line_names_only_the_geometry_it_holds():
    assert _held_geometry(("cell_a", "orient_x")) == "every other parameter (distance, beam, detector) held"
    assert _held_geometry(("cell_a", "distance", "beam_x", "beam_y")) == "every other parameter (detector) held"
    assert _held_geometry(("cell_a", "distance", "beam_x", "detector_rotz")) == "every other parameter held"
    # the names as a joint run expands them: the detector group is all of it; the beam's widths are not its centre
    space = ParameterSpace(symmetry="orthorhombic")
    assert _held_geometry(space.expand(("cell", "detector"))) == "every other parameter held"
    assert _held_geometry(space.expand(("cell", "beam_centre"))) == "every other parameter (distance, detector) held"
    assert _held_geometry(("cell_a", "dispersion")) == "every other parameter (distance, beam, detector) held"


def test_sweep_from_a_start_outside_the_windows_begins_at_the_indexed_spots(refine_cli, sweep):
    """A start 3 % off in the cell and 0.5 deg in orientation puts the spots outside the fitted windows (+-3 px) and
    the wedge; the indexed spots of the .refl (indexed from the document's own axes: an independent check of the
    multi-axis reduction) bring the start back, and the pixels refine it to the truth.  (1 % off is within the
    windows here, and the run starts from the model as given.)"""
    folder, _ = sweep
    r = refine_cli("--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
                   str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--start",
                   "cell_a=82.4,cell_c=103,orient_x=0.5,orient_y=0.5,orient_z=0.2", "--max-steps", "40", "--no-esds",
                   "--out-dir", "off", "--shared", "cell,orientation")  # the truth's geometry held
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if "start from the" in x)
    assert "indexed spots of sweep.refl" in line
    rms_start, rms_end = (float(v) for v in re.findall(r"([0-9.eE+-]+) px", line))
    assert rms_start > 0.5 and rms_end < 0.05, line
    doc = json.loads((r.tmp / "off" / "joint.json").read_text())
    assert doc["status"] == "converged", doc["message"]
    shared = doc["shared"]
    assert abs(shared["cell_a"] / CELL[0] - 1) < 1e-3 and abs(shared["cell_c"] / CELL[2] - 1) < 2.5e-3, shared


def test_per_image_spot_reports_under_two_torchrun_processes(refine_cli, sweep, tmp_path):
    """torchrun --nproc-per-node 2 (gloo on loopback): each process measures the spots of its own images
    (refine.many.distributed.image_shard) and process 0 gathers them; every image's spot report and the pooled one
    equal the one-process run's."""
    folder, spots_per_image = sweep
    argv = ["--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
            str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--max-steps", "5", "--no-esds"]
    one = refine_cli(*argv, "--out-dir", "one")
    assert one.code == 0, one.err
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "NANOBRAGG_DISABLE_COMPILE": "1", "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), "-m", "refine.cli", *argv, "--out-dir",
                           str(tmp_path / "two")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    a = json.loads((one.tmp / "one" / "joint.json").read_text())
    b = json.loads((tmp_path / "two" / "joint.json").read_text())
    assert a["world_size"] == 1 and b["world_size"] == 2
    assert [im["spots"]["n"] for im in b["images"]] == spots_per_image and b["spots"]["n"] == sum(spots_per_image)
    for x, y in zip([a["spots"]] + [im["spots"] for im in a["images"]], [b["spots"]] + [im["spots"] for im in b["images"]]):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=1e-9, abs=1e-12, nan_ok=True), key
    assert a["warnings"] == b["warnings"]


def test_a_poor_crystal_model_is_warned_of():
    """The joint run's warning of a crystal model that fits neither the pixels nor the spots (the real sweep with the
    profile's model held: 4.8x shot noise, 0.54 px); either alone, or a good model, gives none."""
    text = model_warning(4.8, 0.54, ("cell", "orientation"))
    assert "fit 4.8x shot noise" in text and "rms 0.54 px" in text and "--shared ...,mosaic" in text
    assert "--shared" not in model_warning(4.8, 0.54, ("cell", "orientation", "mosaic"))
    assert model_warning(4.8, 0.45, ("cell",)) is None and model_warning(2.5, 0.9, ("cell",)) is None
    assert model_warning(math.nan, 0.9, ("cell",)) is None


@pytest.mark.parametrize("case,message", [
    ("size", "sweep_00002.cbf: image is 40 x 40 pixels (fast x slow) but the experiment's detector is 48 x 48"),
    ("angle", "sweep_00002.cbf: its header's rotation (11 deg, width 0.5) is off the experiment's scan, which has "
              "image 2 at 10.5 deg"),
    ("template", "other_00002.cbf: not a file of the experiment's template sweep_#####.cbf"),
    ("range", "sweep_00007.cbf: image number 7 is not in the experiment's scan (images 1..3"),
    ("missing", "sweep_00003.cbf: image file not found"),
])
def test_images_that_do_not_match_the_experiment_are_refused_first(refine_cli, sweep, tmp_path, case, message):
    folder, _ = sweep
    img = simulate(" ".join(experiment_flags(read_expt(folder / "truth.expt"), 1)) + f" {CRYSTAL}", background=2.0)
    names = {"size": "sweep_00002.cbf", "angle": "sweep_00002.cbf", "template": "other_00002.cbf",
             "range": "sweep_00007.cbf", "missing": "sweep_00002.cbf"}
    header = {"pixel_size_mm": 0.1, **({"start_angle_deg": 11.0, "angle_increment_deg": 0.5} if case == "angle" else {})}
    write_cbf(tmp_path / "sweep_00001.cbf", img, {"pixel_size_mm": 0.1})
    write_cbf(tmp_path / names[case], img[:40, :40] if case == "size" else img, header)
    images = ["sweep_00001.cbf", names[case]] + (["sweep_00003.cbf"] if case == "missing" else [])
    r = refine_cli("--images", *images, "--expt", str(folder / "truth.expt"), "--refl", str(folder / "sweep.refl"),
                   "--rotation-series", "--model", CRYSTAL, "--out-dir", "refused")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert message in r.err
    assert not (tmp_path / "refused").exists() and "sweep_00001.cbf:" not in r.out  # before any image is loaded


@pytest.mark.slow
@pytest.mark.skipif(not (REAL / "23_integrated.expt").is_file(), reason="the real L-cysteine sweep is not here")
def test_real_lcysteine_sweep(refine_cli):
    """The issue's command on the real sweep, no hand-made file or model flag, from DIALS's model and from a start
    1 % off in the cell and 0.3 deg in orientation: both converge (not the step limit) to the same cell and spots.

    Measured (docs/sweep-from-dials.md; docs/log.md 2026-11-29): the defaults for a sweep from DIALS files (one amplitude per unique
    reflection in the experiment's space group; the distance and beam centre refined with a prior at DIALS's values
    as wide as its 17 spots allow, 0.17 mm and 0.05, 0.03 mm; the even set of 40 mosaic domains of the C's law) give
    a -0.086 %, b +0.037 %, c +0.079 % from the full-data cell (DIALS's own wedge cell: +0.46, +0.07, +0.15 %),
    sandwich esds 0.11, 0.09, 0.05 %; spot rms 0.445 -> 0.409 px against DIALS's observed centroids, each compared
    with the model's centroid over its whole shoebox (the centroids' own noise: 0.44 px); fit 3.15x shot noise;
    converged in 35 steps (36 before the prior), no line-search trial at a NaN/Inf loss (6 before the amplitudes'
    limit).  The issue's goal (0.1 % on every axis, 0.5 px) is met.  The bounds are the measured values plus a few
    hundredths of a per cent (and the goal): a change that moves the cell or the spots by more fails here."""
    reference = {"cell_a": 5.428, "cell_b": 8.141, "cell_c": 12.038}
    measured = {"cell_a": -0.086e-2, "cell_b": 0.037e-2, "cell_c": 0.079e-2}
    # DIALS's cell (5.4529, 8.1468, 12.0555) + 1 %, the crystal turned by 0.3 deg (orient: a small lab rotation)
    off = ["--start", "cell_a=5.5074,cell_b=8.2283,cell_c=12.1761,orient_x=0.2,orient_y=0.2,orient_z=0.1"]
    docs = []
    for name, extra in (("dials", []), ("off", off)):
        r = refine_cli("--images", str(REAL / "l-cyst_02_*.cbf"), "--expt", str(REAL / "23_integrated.expt"),
                       "--refl", str(REAL / "23_integrated.refl"), "--rotation-series", "--out-dir", name, *extra)
        assert r.code == 0, r.err
        doc = json.loads((r.tmp / name / "joint.json").read_text())
        assert doc["status"] == "converged", doc["message"]
        assert doc["steps"] < 40 and "NaN/Inf" not in doc["message"], doc["message"]
        assert set(doc["priors"]) == {"distance", "beam_x", "beam_y"}, doc.get("priors")
        for key, value in reference.items():
            offset = doc["shared"][key] / value - 1
            assert abs(offset - measured[key]) <= 0.03e-2 and abs(offset) <= 0.1e-2, (key, doc["shared"][key])
        assert {"distance", "beam_x", "beam_y"} <= set(doc["shared_esds"]), doc["shared_esds"]
        assert doc["spots"]["n"] == 17 and doc["spots"]["rms_px_final_common"] <= 0.5
        assert doc["fit"]["excess"] < 3.4 and doc["mosaic_domains"]["domains"] == 40
        assert doc["structure_factors"]["space_group"].replace(" ", "") == "P222", doc["structure_factors"]
        assert not any("the crystal model reproduces neither" in w for w in doc["warnings"]), doc["warnings"]
        docs.append(doc)
    for key in reference:  # from 1 % off, the same minimum
        assert docs[1]["shared"][key] == pytest.approx(docs[0]["shared"][key], rel=1e-5)


def test_default_schedule_with_spot_windows_far_from_the_beam(refine_cli, tmp_path):
    """The default schedule's first stages fit a disc around the direct beam; with the beam 100 pixels off a 48 x 48
    detector (a swung detector, as on the real sweep) and spot windows, that disc held no fitted pixel and the run
    stopped with "view: every pixel is masked"; the disc now reaches the nearest fitted pixels."""
    model = ("-cell 30 30 40 90 90 90 -misset 10 20 30 -N 5 -default_F 100 -mosaic 0.2 -mosaic_dom 2 -oversample 1 "
             "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 48 -Xbeam 12.4 -Ybeam 2.4")
    write_cbf(tmp_path / "far.cbf", simulate(model, scale=5.0, background=1.0), {"pixel_size_mm": 0.1})
    r = refine_cli("--image", "far.cbf", "--model", model, "--spots", "find", "--spot-window", "3", "--max-steps", "2",
                   "--no-esds")
    assert r.code == 0, r.err
    doc = r.json()
    assert [s["name"] for s in doc["stages"]][:2] == ["beam_centre", "orientation"] and doc["spots"]["n"] >= 3


def test_the_sweeps_natural_command_parses_each_dials_file_once(refine_cli, sweep, monkeypatch):
    """The natural command (``--images --expt --refl --rotation-series``) parses its ``.expt`` once and its ``.refl``
    once, however many of its steps (checks, images, spots, profile, prior, windows, the written files) look at
    them (:func:`nbtorch.io.dials.parsed`); a file changed on disk is parsed again."""
    import nbtorch.io.dials as dials_io

    parses: dict[str, int] = {}

    def counting(parse):
        def counted(path):
            parses[os.path.basename(path)] = parses.get(os.path.basename(path), 0) + 1
            return parse(path)
        counted.__name__ = parse.__name__
        return counted

    monkeypatch.setattr(dials_io, "_parse_json", counting(dials_io._parse_json))
    monkeypatch.setattr(dials_io, "_parse_refl", counting(dials_io._parse_refl))
    dials_io.forget_parsed()
    folder, _ = sweep
    r = refine_cli("--images", str(folder / "sweep_*.cbf"), "--expt", str(folder / "truth.expt"), "--refl",
                   str(folder / "sweep.refl"), "--rotation-series", "--model", CRYSTAL, "--max-steps", "1",
                   "--no-esds", "--out-dir", "once")
    assert r.code == 0, r.err
    assert parses == {"truth.expt": 1, "sweep.refl": 1}, parses
    copy = r.tmp / "changed.expt"
    copy.write_bytes((folder / "truth.expt").read_bytes())
    dials_io.read_expt(copy)
    copy.write_text(copy.read_text() + " ")  # another size: parsed again
    dials_io.read_expt(copy)
    assert parses["changed.expt"] == 2
