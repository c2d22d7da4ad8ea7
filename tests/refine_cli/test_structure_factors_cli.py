"""nbtorch-refine --structure-factors: the amplitudes stage, result.json's structure_factors, the -hkl file
(read back by the simulator's own reader), the report and the option errors."""

from __future__ import annotations

import numpy as np
import pytest

from nbtorch.io.hkl import read_hkl

pytest.importorskip("gemmi")

TINY = ("--problem", "orthorhombic_xds", "--size", "40")


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
