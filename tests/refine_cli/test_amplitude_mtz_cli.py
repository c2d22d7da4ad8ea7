"""nbtorch-refine --structure-factors --mtz-out and --anomalous: the MTZ file read back by gemmi (columns, values,
space group, refined cell), anomalous pairs recovered from a still simulated with F(+) != F(-), and the refusals
(one line, exit 2, nothing written).  The joint run's MTZ: test_structure_factors_cli.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import simulate
from nbtorch.errors import InputError
from nbtorch.io.cbf import write_cbf
from nbtorch.io.hkl import HKLTable, write_hkl
from refine.fitting.space_groups import check_subgroup
from refine.output.results import load_h5

gemmi = pytest.importorskip("gemmi")

TINY = ("--problem", "orthorhombic_xds", "--size", "40")
CELL = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")


def _mtz(path):
    mtz = gemmi.read_mtz_file(str(path))
    data = np.array(mtz, copy=False)
    return mtz, {label: data[:, i] for i, label in enumerate(mtz.column_labels())}


def test_single_run_writes_an_mtz_of_the_refined_amplitudes(refine_cli):
    r = refine_cli(*TINY, "--refine", "background,cell,structure_factors", "--max-steps", "6", "--structure-factors",
                   "--space-group", "P1", "--f-start", "file", "--out", "res.h5", "--mtz-out", "amps.mtz")
    assert r.code == 0, r.err
    doc = r.json("res.json")
    refined = {(h, k, l): (F, esd) for h, k, l, _, F, esd, free in doc["structure_factors"]["reflections"] if free}
    mtz, col = _mtz(r.tmp / "amps.mtz")
    assert mtz.column_labels() == ["H", "K", "L", "F", "SIGF", "NOBS"]
    assert [c.type for c in mtz.columns] == ["H", "H", "H", "F", "Q", "I"]
    assert mtz.spacegroup.hm == "P 1" and len(col["H"]) == len(refined) > 10  # the held candidates left out
    assert list(mtz.cell.parameters) == pytest.approx([doc["params"][n] for n in CELL], rel=1e-6)
    assert doc["params"]["cell_a"] != doc["initial_params"]["cell_a"]  # the refined cell, not the start
    for h, k, l, F, sigf, nobs in zip(col["H"], col["K"], col["L"], col["F"], col["SIGF"], col["NOBS"]):
        want = refined[(int(h), int(k), int(l))]
        assert F == pytest.approx(want[0], rel=1e-6) and sigf == pytest.approx(want[1], rel=1e-6) and nobs == 1
    assert "amps.mtz" in r.out


@pytest.mark.parametrize("extra, message", [
    pytest.param(("--structure-factors", "--space-group", "P1", "--mtz-out", "missing/amps.mtz"),
                 "--mtz-out missing/amps.mtz: folder missing does not exist", id="mtz folder missing"),
    pytest.param(("--structure-factors", "--space-group", "P1", "--mtz-out", "."), "is a directory", id="mtz folder"),
    pytest.param(("--mtz-out", "amps.mtz"), "--mtz-out: only with --structure-factors", id="mtz without amplitudes"),
    pytest.param(("--anomalous",), "--anomalous: only with --structure-factors", id="anomalous without amplitudes"),
    pytest.param(("--structure-factors", "--space-group", "P1", "--anomalous-restraint", "0.3"),
                 "--anomalous-restraint: only with --anomalous", id="pair restraint without pairs"),
    pytest.param(("--structure-factors", "--space-group", "P-1", "--anomalous"), "centrosymmetric space group P-1",
                 id="anomalous centrosymmetric"),
])
def test_refusals_write_nothing(refine_cli, extra, message):
    r = refine_cli(*TINY, "--refine", "background", "--out", "res.h5", *extra)
    assert r.code == 2 and r.err.count("\n") == 1 and "Traceback" not in r.err
    assert message in r.err
    assert sorted(p.name for p in r.tmp.iterdir()) == []


def test_the_mtz_may_go_to_the_folder_the_run_makes(tmp_path, monkeypatch):
    """Its folder exists, or is the one the run makes for its results (--out's, a joint run's --out-dir)."""
    from refine.cli.parser import parse_args
    from refine.modes.single import amplitude_options

    monkeypatch.chdir(tmp_path)
    sf = ["--structure-factors", "--space-group", "P1"]
    single = ["--problem", "orthorhombic_xds", *sf, "--out", "new/res.h5"]
    assert amplitude_options(parse_args([*single, "--mtz-out", "new/amps.mtz"])) is not None
    joint = ["--images", "a.cbf", "b.cbf", "--model", "-cell 30 30 40 90 90 90", "--joint", *sf, "--out-dir", "run"]
    assert amplitude_options(parse_args([*joint, "--mtz-out", "run/amps.mtz"])) is not None
    with pytest.raises(InputError, match="--mtz-out other/amps.mtz: folder other does not exist"):
        amplitude_options(parse_args([*joint, "--mtz-out", "other/amps.mtz"]))
    assert sorted(tmp_path.iterdir()) == []


def test_a_space_group_that_contradicts_the_experiment_is_refused(refine_cli, tmp_path):
    from test_dials_still import still_document  # a P 4 still

    (tmp_path / "still.expt").write_text(json.dumps(still_document()))
    (tmp_path / "obs.cbf").write_bytes(b"")
    base = ("--image", "obs.cbf", "--expt", "still.expt", "--structure-factors", "--out", "res.h5")
    r = refine_cli(*base, "--space-group", "P222")
    assert r.code == 2 and r.err.count("\n") == 1
    assert "--space-group P222: contradicts the --expt crystal's space group P 4" in r.err
    r = refine_cli(*base, "--symmetry", "P422")
    assert r.code == 2 and "--symmetry P422: contradicts" in r.err and "point group 422, lattice P: not within 4, P" in r.err
    r = refine_cli(*base, "--space-group", "I4")
    assert r.code == 2 and "lattice I: not within 4, P" in r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["obs.cbf", "still.expt"]
    # a subgroup, or screw axes the indexing group lacks, are the experiment's symmetry
    for given, experiment in (("P1", "P 4"), ("P41", "P 4"), ("P41212", "P 4 2 2"), ("P2", "C 1 2 1")):
        check_subgroup(given, "--space-group", experiment)


def _anomalous_still(folder) -> None:
    """A 48 x 48 still of a P222 crystal whose acentric reflections have F(+) 125 and F(-) 80 (centric ones
    100), every index listed in the -hkl file; the model to refine: -default_F 100 for all."""
    group = gemmi.SpaceGroup("P 2 2 2")
    ops, asu = group.operations(), gemmi.ReciprocalAsu(group)
    rows = []
    for hkl in np.array(np.meshgrid(*[np.arange(-9, 10)] * 3, indexing="ij")).reshape(3, -1).T.tolist():
        acentric = not ops.is_reflection_centric(hkl)
        rows.append([*hkl, (125.0 if asu.to_asu(hkl, ops)[1] % 2 else 80.0) if acentric else 100.0])
    a = np.array(rows)
    write_hkl(folder / "truth.hkl", HKLTable(h=a[:, 0], k=a[:, 1], l=a[:, 2], F=a[:, 3]))
    geometry = "-lambda 1.0 -distance 25 -pixel 0.1 -detpixels 48 -Xbeam 2.45 -Ybeam 2.45"
    crystal = "-cell 30 30 40 90 90 90 -N 12 -mosaic 0.1 -mosaic_dom 2 -oversample 1 -misset 10 20 30"
    img = simulate(f"{crystal} -hkl {folder / 'truth.hkl'} -default_F 100 {geometry}", background=1.0, seed=3)
    write_cbf(folder / "still.cbf", img, {"pixel_size_mm": 0.1})
    (folder / "model.txt").write_text(f"{crystal} -default_F 100 {geometry}")


def test_anomalous_pairs_recover_the_sign_of_the_difference(refine_cli, tmp_path):
    _anomalous_still(tmp_path)
    r = refine_cli("--image", "still.cbf", "--model", "@model.txt", "--refine", "background,structure_factors",
                   "--structure-factors", "--space-group", "P222", "--anomalous", "--anomalous-restraint", "2",
                   "--f-start", "one", "--max-steps", "10", "--out", "res.h5", "--mtz-out", "amps.mtz")
    assert r.code == 0, r.err
    sf = r.json("res.json")["structure_factors"]
    pairs = sf["anomalous"]["rows"]
    dano = np.array([row[7] for row in pairs])
    assert len(pairs) >= 4 and np.all(dano > 0)  # truth: F(+) - F(-) = 45 on the scale of F(000)'s 100
    assert all(row[2] is not None and row[4] is not None and row[6] is not None for row in pairs)
    mtz, col = _mtz(r.tmp / "amps.mtz")
    assert mtz.column_labels() == ["H", "K", "L", "F", "SIGF", "NOBS", "F(+)", "SIGF(+)", "F(-)", "SIGF(-)", "DANO",
                                   "SIGDANO"]
    assert [c.type for c in mtz.columns][6:] == ["G", "L", "G", "L", "D", "Q"] and mtz.spacegroup.hm == "P 2 2 2"
    got = {(int(h), int(k), int(l)): d for h, k, l, d in zip(col["H"], col["K"], col["L"], col["DANO"])}
    for h, k, l, fp, sp, fm, sm, d, sd in pairs:
        assert got[(h, k, l)] == pytest.approx(d, rel=1e-5) and d == pytest.approx(fp - fm)
        assert sd == pytest.approx(np.hypot(sp, sm))
    centric = ~np.isfinite(col["DANO"])  # a centric reflection (or half a pair): DANO missing
    assert np.any(centric) and np.all(np.isfinite(col["F"]))
    assert f"anomalous pairs: {len(pairs)} with both F(+) and F(-) refined" in r.out
    h5 = load_h5(r.tmp / "res.h5")["structure_factors"]["anomalous"]
    assert h5["dano"] == pytest.approx(dano) and list(h5["h"]) == [row[0] for row in pairs]


def test_joint_anomalous_pairs_and_their_observing_stills(refine_cli, tmp_path):
    from test_structure_factors_cli import _two_stills  # two P4 stills, F 100 for all

    r = refine_cli(*_two_stills(tmp_path), "--symmetry", "P4", "--structure-factors", "--f-min-photons", "30",
                   "--per-image", "scale,background", "--max-steps", "3", "--out-dir", "joint", "--anomalous",
                   "--anomalous-restraint", "0.5", "--mtz-out", "amps.mtz")
    assert r.code == 0, r.err
    doc = json.loads((r.tmp / "joint" / "joint.json").read_text())
    sf = doc["structure_factors"]
    assert sf["anomalous"]["rows"] and sf["restraint_final"] > 0
    mtz, col = _mtz(r.tmp / "amps.mtz")
    assert "DANO" in mtz.column_labels() and mtz.spacegroup.hm == "P 4"
    assert np.all(np.isfinite(col["SIGF"])) and np.all(col["SIGF"] > 0)  # the amplitudes' esds of the joint run
    assert np.all(np.isfinite(col["SIGDANO"][np.isfinite(col["DANO"])]))
    rows = {tuple(row[:3]): (nobs, pair) for row, nobs, pair in zip(sf["reflections"], sf["nobs"], sf["nobs_pair"])}
    for h, k, l, nobs in zip(col["H"], col["K"], col["L"], col["NOBS"]):
        mates = [rows[m] for m in ((h, k, l), (-h, -k, -l)) if m in rows]
        assert nobs == max(pair for _, pair in mates) >= max(n for n, _ in mates)
    assert np.any(col["NOBS"] == 2)
