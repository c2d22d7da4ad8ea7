"""nbtorch-refine --structure-factors: the amplitudes stage, result.json's structure_factors, the -hkl file
(read back by the simulator's own reader), the report and the option errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nbtorch.io.hkl import read_hkl

pytest.importorskip("gemmi")

TINY = ("--problem", "orthorhombic_xds", "--size", "40")
CELL = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")


def test_structure_factors_run_writes_amplitudes(refine_cli):
    r = refine_cli(*TINY, "--refine", "background,cell,structure_factors", "--max-steps", "6",
                   "--structure-factors", "--space-group", "P1", "--f-start", "file", "--f-restraint", "0.5",
                   "--out", "res.h5", "--esd-extra", "distance")
    assert r.code == 0, r.err
    doc = r.json("res.json")
    sf = doc["structure_factors"]
    assert sf["space_group"] == "P 1" and sf["start"] == "file" and sf["n_free"] > 10
    names = [n for n in doc["free"] if n.startswith("F_")]
    assert len(names) == sf["n_free"] and all(doc["esds"].get(n, 0) > 0 for n in names)
    assert sf["n_held"] == sum(1 for row in sf["reflections"] if not row[6]) > 0  # the faint candidates
    row = next(row for row in sf["reflections"] if row[6])
    assert doc["refined"][f"F_{row[0]}_{row[1]}_{row[2]}"] == pytest.approx(row[4])
    table = read_hkl(str(r.tmp / "res.hkl"))  # every Friedel mate written: P1 has two entries per amplitude
    assert len(table) == 2 * len(sf["reflections"])
    got = {(int(h), int(k), int(l)): F for h, k, l, F in zip(table.h, table.k, table.l, table.F)}  # noqa: E741
    assert got[(row[0], row[1], row[2])] == pytest.approx(row[4]) == got[(-row[0], -row[1], -row[2])]
    assert f"structure factors: {sf['n_free']} amplitudes refined in P 1" in r.out and "candidates held" in r.out
    assert "structure-factor amplitudes" not in r.out.split("parameter")[0]  # the table lists no F_h_k_l rows
    assert not any(line.lstrip().startswith("F_") for line in r.out.splitlines())


@pytest.mark.parametrize("extra, message", [
    (("--structure-factors",), "give the space group"),
    (("--structure-factors", "--space-group", "P 99 z"), "unknown space group"),
    (("--f-restraint", "0.5"), "--f-restraint: only with --structure-factors"),
    (("--space-group", "P1"), "--space-group: only with --structure-factors"),
    (("--structure-factors", "--space-group", "P1", "--f-restraint", "-1"), "restraint sigma must be > 0"),
])
def test_structure_factor_option_errors(refine_cli, extra, message):
    r = refine_cli(*TINY, "--refine", "background", *extra)
    assert r.code == 2
    assert message in r.err and "Traceback" not in r.err


def _two_stills(tmp_path) -> tuple[str, ...]:
    from cli_helpers import simulate
    from nbtorch.io.cbf import write_cbf

    geometry = "-lambda 1.0 -distance 40 -pixel 0.1 -detpixels 40 -Xbeam 2.05 -Ybeam 2.05"
    crystal = "-cell 30 30 40 90 90 90 -N 12 -default_F 100 -mosaic 0.1 -mosaic_dom 2 -oversample 1"
    for k, misset in enumerate(("10 20 30", "-40 5 75")):
        img = simulate(f"{crystal} -misset {misset} {geometry}", background=1.0, seed=30 + k)
        write_cbf(tmp_path / f"still_{k}.cbf", img, {"pixel_size_mm": 0.1})
        (tmp_path / f"still_{k}.txt").write_text(f"{crystal} -misset {misset} {geometry}")
    return "--images", "still_0.cbf", "still_1.cbf", "--model", "@{stem}.txt", "--joint"


def test_joint_structure_factors_run_writes_the_shared_table(refine_cli, tmp_path):
    r = refine_cli(*_two_stills(tmp_path), "--symmetry", "P4", "--structure-factors", "--f-min-photons", "30",
                   "--per-image", "scale,background", "--max-steps", "5", "--out-dir", "joint", "--no-esds",
                   "--mtz-out", "amps.mtz")
    assert r.code == 0, r.err
    doc = json.loads((r.tmp / "joint" / "joint.json").read_text())
    sf = doc["structure_factors"]
    assert sf["space_group"] == "P 4" and sf["start"] == "estimate" and sf["n_free"] > 5
    assert sum(n.startswith("F_") for n in doc["shared_names"]) == sf["n_free"]
    # the geometry first (its own loop and checkpoint), then the amplitudes (image 0's scale held: test_joint_structure_factors)
    assert doc["message"].startswith("geometry: ") and (r.tmp / "joint" / "joint.ckpt.geometry.h5").exists()
    table = read_hkl(str(r.tmp / "joint" / "joint.hkl"))
    assert len(table) >= 4 * len(sf["reflections"])  # P4: every equivalent and Friedel mate
    assert "structure factors: " in r.out and "joint.hkl" in r.out
    # the MTZ: the refined amplitudes, SIGF missing without esds (said), NOBS the stills that see each
    import gemmi

    mtz = gemmi.read_mtz_file(str(r.tmp / "amps.mtz"))
    col = dict(zip(mtz.column_labels(), np.array(mtz, copy=False).T))
    assert mtz.column_labels() == ["H", "K", "L", "F", "SIGF", "NOBS"] and mtz.spacegroup.hm == "P 4"
    assert list(mtz.cell.parameters) == pytest.approx([doc["params"][n] for n in CELL], rel=1e-6)
    refined = [(row, nobs) for row, nobs in zip(sf["reflections"], sf["nobs"]) if row[6]]
    assert len(col["F"]) == len(refined) and np.all(np.isnan(col["SIGF"]))
    assert col["F"] == pytest.approx([row[4] for row, _ in refined], rel=1e-6)
    assert list(col["NOBS"]) == [nobs for _, nobs in refined] and set(col["NOBS"]) <= {1, 2} and 2 in col["NOBS"]
    assert "amps.mtz: SIGF (and SIGDANO) missing" in r.out
    # a run stopped in its geometry stage left only that stage's checkpoint: --resume continues from it
    (r.tmp / "joint" / "joint.ckpt.h5").unlink()
    again = refine_cli(*_two_stills(tmp_path), "--symmetry", "P4", "--structure-factors", "--f-min-photons", "30",
                       "--per-image", "scale,background", "--max-steps", "5", "--out-dir", "joint", "--no-esds",
                       "--resume")
    assert again.code == 0, again.err
    assert json.loads((r.tmp / "joint" / "joint.json").read_text())["structure_factors"]["n_free"] == sf["n_free"]


@pytest.mark.parametrize("extra, message", [
    (("--structure-factors",), "give the space group"),
    (("--structure-factors", "--space-group", "P1", "--shared", "cell,scale", "--per-image", "background"),
     "scale cannot be shared with structure_factors"),
    (("--space-group", "P1"), "--space-group: only with --structure-factors"),
])
def test_joint_structure_factor_option_errors(refine_cli, tmp_path, extra, message):
    for k in range(2):
        (tmp_path / f"still_{k}.cbf").write_bytes(b"")
    r = refine_cli("--images", "still_0.cbf", "still_1.cbf", "--model", "-cell 30 30 40 90 90 90", "--joint", *extra)
    assert r.code == 2 and r.err.count("\n") == 1
    assert message in r.err and "Traceback" not in r.err
