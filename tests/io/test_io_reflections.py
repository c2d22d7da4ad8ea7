"""Reference structure factors through gemmi: MTZ, mmCIF reflection files and models (nbtorch.io.reflections),
and their use as the simulator's ``-hkl`` table."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from nbtorch.errors import InputError
from nbtorch.io.reflections import expand_to_p1, is_reflection_file, read_reflection_file

gemmi = pytest.importorskip("gemmi", reason="reference structure factors need gemmi (pip install 'nbtorch[formats]')")

DATA = Path(__file__).resolve().parents[1] / "data" / "structure_factors"


def _as_dict(table) -> dict[tuple[int, int, int], float]:
    return {(int(h), int(k), int(l)): float(F) for h, k, l, F in zip(table.h, table.k, table.l, table.F)}


def _write_mtz(path: Path, sg: str, cell, hkl, columns: dict[str, tuple[str, np.ndarray]]) -> Path:
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(sg)
    mtz.set_cell_for_all(gemmi.UnitCell(*cell))
    mtz.add_dataset("test")
    for label, (kind, _) in columns.items():
        mtz.add_column(label, kind)
    data = np.column_stack([np.asarray(hkl, dtype=np.float32)] + [v.astype(np.float32) for _, v in columns.values()])
    mtz.set_data(data)
    mtz.write_to_file(str(path))
    return path


HKL = np.array([[1, 2, 3], [2, 0, 5], [3, 3, 0], [0, 0, 4], [4, 1, 7]])
F = np.array([10.0, 20.0, 30.0, 40.0, 50.0])


def test_mtz_expands_every_symmetry_equivalent_and_friedel_mate(tmp_path):
    path = _write_mtz(tmp_path / "t.mtz", "P 41 21 2", (57.8, 57.8, 150.0, 90, 90, 90), HKL,
                      {"F": ("F", F), "SIGF": ("Q", F / 10)})
    ref = read_reflection_file(path)
    table = _as_dict(ref.table)
    sg = gemmi.SpaceGroup("P 41 21 2")
    for hkl, f in zip(HKL, F):
        for op in sg.operations().sym_ops:
            eq = op.apply_to_hkl([int(v) for v in hkl])
            assert table[tuple(eq)] == pytest.approx(f)
            assert table[tuple(-v for v in eq)] == pytest.approx(f)
    # nothing else: every listed index is an equivalent of a file reflection
    asu = gemmi.ReciprocalAsu(sg)
    originals = {tuple(asu.to_asu([h, k, l], sg.operations())[0]) for h, k, l in HKL}
    assert {tuple(asu.to_asu(list(k), sg.operations())[0]) for k in table} == originals
    assert ref.unique == 5 and ref.spacegroup == "P 41 21 2"
    assert "column F of an MTZ file" in ref.note() and "57.8 57.8 150" in ref.note()


def test_mtz_column_choice(tmp_path):
    path = _write_mtz(tmp_path / "two.mtz", "P 1", (50, 60, 70, 90, 90, 90), HKL,
                      {"FP": ("F", F), "FC": ("F", 2 * F), "I": ("J", F * F)})
    with pytest.raises(InputError, match=r"two.mtz: choose the amplitude column with -hkl_column .*: FP, FC$"):
        read_reflection_file(path)
    assert _as_dict(read_reflection_file(path, column="FC").table)[(1, 2, 3)] == 20.0
    with pytest.raises(InputError, match=r"no column 'F'; columns: H, K, L, FP, FC, I"):
        read_reflection_file(path, column="F")
    with pytest.raises(InputError, match=r"column 'I' is of MTZ type 'J', not an amplitude"):
        read_reflection_file(path, column="I")


def test_missing_and_negative_amplitudes(tmp_path):
    values = F.copy()
    values[1] = np.nan
    ref = read_reflection_file(_write_mtz(tmp_path / "nan.mtz", "P 1", (50, 60, 70, 90, 90, 90), HKL,
                                          {"F": ("F", values)}))
    assert ref.unique == 4 and (2, 0, 5) not in _as_dict(ref.table)
    values[1] = -3.0
    with pytest.raises(InputError, match="negative amplitudes"):
        read_reflection_file(_write_mtz(tmp_path / "neg.mtz", "P 1", (50, 60, 70, 90, 90, 90), HKL,
                                        {"F": ("F", values)}))


def test_real_mtz_and_model_agree():
    """The deposited amplitudes of 5E5Z and |F_calc| of its deposited model correlate as a refined model's do."""
    measured = _as_dict(read_reflection_file(DATA / "5e5z.mtz").table)
    model = read_reflection_file(DATA / "5e5z.pdb", dmin_A=1.66)
    assert model.spacegroup == "P 1 21 1" and "47 atoms" in model.note()
    calc = _as_dict(model.table)
    common = sorted(set(measured) & set(calc))
    assert len(common) > 1200
    r = np.corrcoef([measured[k] for k in common], [calc[k] for k in common])[0, 1]
    assert r > 0.85
    # P 1 21 1: (h k l), (-h k -l) and Friedel mates share one value
    for h, k, l in common[:50]:
        assert calc[(h, k, l)] == calc[(-h, k, -l)] == calc[(-h, -k, -l)]


def test_real_mmcif_reflections():
    ref = read_reflection_file(DATA / "4aap-sf-subset.cif")
    assert ref.spacegroup == "P 32 2 1" and ref.unique > 0
    assert "F_meas_au" in ref.what
    calc = read_reflection_file(DATA / "4aap-sf-subset.cif", column="F_calc")
    assert calc.unique >= ref.unique
    with pytest.raises(InputError, match="no column 'FP'"):
        read_reflection_file(DATA / "4aap-sf-subset.cif", column="FP")


def test_single_atom_model_is_its_form_factor(tmp_path):
    """One carbon at the origin of a P 1 cell, B = 0: |F(hkl)| is the carbon form factor at that resolution,
    falling with resolution."""
    pdb = tmp_path / "c.pdb"
    pdb.write_text("CRYST1   10.000   10.000   10.000  90.00  90.00  90.00 P 1           1\n"
                   "HETATM    1  C   UNL A   1       0.000   0.000   0.000  1.00  0.00           C\nEND\n")
    table = _as_dict(read_reflection_file(pdb, dmin_A=2.0).table)
    carbon = gemmi.Element("C").it92
    for (h, k, l), f in list(table.items())[:40]:
        stol2 = (h * h + k * k + l * l) / 100.0 / 4.0
        assert f == pytest.approx(carbon.calculate_sf(stol2), rel=1e-4)
    assert table[(1, 0, 0)] > table[(2, 0, 0)] > table[(4, 0, 0)]


def test_model_needs_a_resolution_and_atoms(tmp_path):
    with pytest.raises(InputError, match="needs a resolution limit"):
        read_reflection_file(DATA / "5e5z.pdb")
    empty = tmp_path / "empty.pdb"
    empty.write_text("CRYST1   10.000   10.000   10.000  90.00  90.00  90.00 P 1           1\nEND\n")
    with pytest.raises(InputError, match="no atoms in the model"):
        read_reflection_file(empty, dmin_A=2.0)


@pytest.mark.parametrize("name", ["5e5z.mtz", "4aap-sf-subset.cif"])
def test_damaged_files_are_one_line(tmp_path, name):
    data = (DATA / name).read_bytes()
    bad = tmp_path / name
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(InputError) as info:
        read_reflection_file(bad)
    assert "\n" not in str(info.value) and str(bad) in str(info.value)


def test_missing_gemmi_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemmi", None)
    with pytest.raises(InputError, match=r"5e5z.mtz: reading MTZ, mmCIF and PDB files needs gemmi: pip install"):
        read_reflection_file(DATA / "5e5z.mtz")


def test_expand_to_p1_keeps_special_reflections_once():
    identity_and_inversion = np.array([np.eye(3, dtype=int), -np.eye(3, dtype=int)])
    hkl, values = expand_to_p1(np.array([[0, 0, 0], [1, 0, 0]]), np.array([5.0, 7.0]), identity_and_inversion)
    assert sorted(map(tuple, hkl)) == [(-1, 0, 0), (0, 0, 0), (1, 0, 0)]
    assert dict(zip(map(tuple, hkl), values))[(-1, 0, 0)] == 7.0


def test_file_kinds():
    assert all(is_reflection_file(n) for n in ("a.mtz", "b.MTZ", "c.cif", "d.pdb", "e.ent.gz", "f.mmcif"))
    assert not any(is_reflection_file(n) for n in ("P1.hkl", "Fdump.bin", "x.txt"))


# ------------------------------------------------------------------------------ in the simulator

SMALL = ["-cell", "9.643", "9.609", "19.029", "90", "101.224", "90", "-N", "3", "-lambda", "1.0", "-distance", "40",
         "-detpixels", "48", "-pixel", "0.4", "-default_F", "1", "-oversample", "1"]


def test_simulator_reads_an_mtz_table(tmp_path):
    import torch

    from nbtorch import Simulator, config_from_args

    src = shutil.copy(DATA / "5e5z.mtz", tmp_path / "5e5z.mtz")
    sim = Simulator(config_from_args(SMALL + ["-hkl", str(src)]), compile=False)
    measured = _as_dict(read_reflection_file(src).table)
    lo = sim.setup.hkl_min.astype(int)
    for (h, k, l), f in list(measured.items())[:100]:
        assert sim.setup.F_grid[h - lo[0], k - lo[1], l - lo[2]] == pytest.approx(f)
    assert any("column FP of an MTZ file" in n for n in sim.setup.notes)
    plain = Simulator(config_from_args(SMALL), compile=False)
    with torch.no_grad():
        a, b = sim().numpy(), plain().numpy()
    assert a.max() > 0 and not np.allclose(a / a.max(), b / b.max())


def test_simulator_computes_from_a_model_to_the_detector_corner(tmp_path):
    from nbtorch import Simulator, config_from_args

    src = shutil.copy(DATA / "5e5z.pdb", tmp_path / "5e5z.pdb")
    sim = Simulator(config_from_args(SMALL + ["-hkl", str(src)]), compile=False)
    note = next(n for n in sim.setup.notes if "|F_calc|" in n)
    # farthest corner of the 19.2 mm square detector from the MOSFLM beam centre (9.8, 9.8) mm, 40 mm away:
    # 2theta = atan(13.86 / 40) = 19.1 deg, d = 1 A / (2 sin 9.56 deg) = 3.01 A, times 0.95
    expected = 0.95 * 1.0 / (2 * np.sin(0.5 * np.arctan(np.hypot(9.8, 9.8) / 40.0)))
    assert f"to {expected:.3g} A" in note and f"{expected:.3g}" == "2.86"
    finer = Simulator(config_from_args(SMALL + ["-hkl", str(src), "-hkl_dmin", "1.2"]), compile=False)
    assert "to 1.2 A" in next(n for n in finer.setup.notes if "|F_calc|" in n)


def test_hkl_flags_errors(tmp_path):
    from nbtorch import config_from_args
    from nbtorch.rules.resolve import resolve

    with pytest.raises(InputError, match=r"-hkl_column FP: only with an MTZ or mmCIF -hkl file"):
        resolve(config_from_args(SMALL + ["-hkl_column", "FP"]))
    with pytest.raises(InputError, match=r"-hkl_dmin: must be positive"):
        resolve(config_from_args(SMALL + ["-hkl", str(DATA / "5e5z.pdb"), "-hkl_dmin", "-1"]))
    with pytest.raises(InputError, match=r"no column 'F'"):
        resolve(config_from_args(SMALL + ["-hkl", str(DATA / "5e5z.mtz"), "-hkl_column", "F"]))


def test_refine_f_column_option():
    from refine.cli.parser import parse_args

    args = parse_args(["--image", "x.cbf", "--model=-hkl ref.mtz -cell 1 2 3 90 90 90", "--f-column", "F-obs"])
    assert args.model.model.endswith("-hkl_column F-obs")
    with pytest.raises(InputError, match="--f-column: .* give --model"):
        parse_args(["--problem", "cubic_mosflm", "--f-column", "FP"])
