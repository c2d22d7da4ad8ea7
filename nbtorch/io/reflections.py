"""Reference structure factors from crystallographic files, read with gemmi.

``-hkl FILE`` takes, besides nanoBragg's text ``h k l F`` (:mod:`nbtorch.io.hkl`):

* an **MTZ** file (``.mtz``): the amplitude column named by ``-hkl_column`` (or ``--f-column`` of
  ``nbtorch-refine``); without it the only column of type F (``FP``, ``F``, ``F-obs`` ...), and an
  error listing them when there are several;
* an **mmCIF reflection file** (``*-sf.cif`` from the PDB, ``.cif``/``.mmcif`` with a ``_refln``
  loop): the column ``-hkl_column`` names, else the first of ``F_meas_au``, ``F_meas``,
  ``pdbx_F_plus``, ``F_calc_au``, ``F_calc``; the first reflection block of the file;
* a **model** (``.pdb``, ``.ent``, or an mmCIF with ``_atom_site``): amplitudes ``|F_calc|`` computed
  by gemmi's direct summation (X-ray form factors, the model's B factors and occupancies, no bulk
  solvent, no hydrogens added) to the resolution ``dmin_A`` (the detector corner's, chosen by
  :mod:`nbtorch.rules.resolve`, unless ``-hkl_dmin`` gives it), with the space group and cell from the file.

Files list the symmetry-unique reflections only; the simulator's table is a dense grid over
h, k, l with no symmetry of its own, so every reflection is expanded to its symmetry equivalents
(the rotation parts of the space group's operations, ``(h k l) R``) and their Friedel mates
(``-h -k -l``; no anomalous signal: ``|F(h)| = |F(-h)|``).  Missing amplitudes (NaN) are left out
and take ``-default_F`` in the grid like any reflection not listed.  The file's cell and space
group are reported in the note; they are not imposed on the model's ``-cell`` (the indices are
what the simulator uses).

gemmi is an optional extra (``pip install 'nbtorch[formats]'``): it is imported when such a file is
read, and a missing gemmi is one error line.  This module does not import torch (an ``io`` rule).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.hkl import HKLTable

__all__ = ["ReferenceAmplitudes", "is_reflection_file", "read_reflection_file", "expand_to_p1", "rotation_parts"]

_MTZ = (".mtz",)
_MODEL = (".pdb", ".ent", ".pdb.gz", ".ent.gz")
_CIF = (".cif", ".mmcif", ".cif.gz", ".mmcif.gz")
_CIF_F_COLUMNS = ("F_meas_au", "F_meas", "pdbx_F_plus", "F_calc_au", "F_calc")


@dataclass(frozen=True)
class ReferenceAmplitudes:
    """Amplitudes read from a reference file, expanded to every index the grid needs.

    ``table``: the expanded reflections (P1, Friedel mates included); ``unique``: how many the file
    gave; ``spacegroup``, ``cell`` (Å, deg): the file's; ``what``: "column FP of an MTZ file", ...
    """

    table: HKLTable
    unique: int
    spacegroup: str
    cell: tuple[float, float, float, float, float, float]
    what: str

    def note(self) -> str:
        """One line for the simulator's notes."""
        a, b, c, al, be, ga = self.cell
        return (f"structure factors: {self.what} ({self.unique} unique reflections in {self.spacegroup}, cell "
                f"{a:g} {b:g} {c:g} {al:g} {be:g} {ga:g}), expanded to {len(self.table)} with symmetry and "
                "Friedel mates")


def is_reflection_file(path: str | os.PathLike[str]) -> bool:
    """True for the files this module reads (by name: MTZ, mmCIF, PDB)."""
    name = str(path).lower()
    return name.endswith(_MTZ + _MODEL + _CIF)


def _gemmi(path: str):
    try:
        import gemmi
    except ImportError:
        raise InputError(f"{path}: reading MTZ, mmCIF and PDB files needs gemmi: pip install 'nbtorch[formats]'") \
            from None
    return gemmi


def expand_to_p1(hkl: np.ndarray, F: np.ndarray, rotations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every symmetry equivalent ``(h k l) R`` of each reflection and its Friedel mate, with the same
    amplitude.  ``hkl``: (n, 3) int; ``rotations``: (m, 3, 3) integer rotation parts of the space
    group's operations (fractional coordinates).  Duplicates (special reflections, centric ones) are
    kept once, the first time they appear."""
    hkl = np.asarray(hkl, dtype=np.int64).reshape(-1, 3)
    F = np.asarray(F, dtype=np.float64).reshape(-1)
    R = np.asarray(rotations, dtype=np.int64).reshape(-1, 3, 3)
    eq = np.einsum("nj,mjk->mnk", hkl, R)  # (m, n, 3): row vector times each rotation
    eq = np.concatenate([eq, -eq]).reshape(-1, 3)
    values = np.tile(F, 2 * len(R))
    _, first = np.unique(eq, axis=0, return_index=True)
    first.sort()
    return eq[first], values[first]


def rotation_parts(gemmi, spacegroup) -> np.ndarray:
    """(m, 3, 3) integer rotation parts of the space group's symmetry operations (centring adds none)."""
    return np.array([np.array(op.rot) // gemmi.Op.DEN for op in spacegroup.operations().sym_ops], dtype=np.int64)


def _finish(path: str, gemmi, spacegroup, cell, hkl: np.ndarray, F: np.ndarray, what: str) -> ReferenceAmplitudes:
    if spacegroup is None:
        raise InputError(f"{path}: no space group in the file; the reflections cannot be expanded")
    keep = np.isfinite(F)
    if np.any(F[keep] < 0):
        raise InputError(f"{path}: {what} has negative amplitudes (is it an intensity or a difference column?)")
    hkl, F = hkl[keep], F[keep]
    if len(F) == 0:
        raise InputError(f"{path}: {what} has no reflection with a value")
    full_hkl, full_F = expand_to_p1(hkl, F, rotation_parts(gemmi, spacegroup))
    table = HKLTable(h=full_hkl[:, 0], k=full_hkl[:, 1], l=full_hkl[:, 2], F=full_F, source=path)
    c = (cell.a, cell.b, cell.c, cell.alpha, cell.beta, cell.gamma)
    return ReferenceAmplitudes(table, int(len(F)), spacegroup.hm, c, what)


def _read_mtz(path: str, gemmi, column: str | None) -> ReferenceAmplitudes:
    try:
        mtz = gemmi.read_mtz_file(path)
    except (RuntimeError, ValueError, OSError) as exc:
        raise InputError(f"{path}: not a readable MTZ file ({exc})") from None
    f_columns = [c.label for c in mtz.columns if c.type == "F"]
    if column is None:
        if len(f_columns) != 1:
            listed = ", ".join(f_columns) if f_columns else "none"
            raise InputError(f"{path}: choose the amplitude column with -hkl_column (--f-column): columns of type F: "
                             f"{listed}")
        column = f_columns[0]
    labels = [c.label for c in mtz.columns]
    if column not in labels:
        raise InputError(f"{path}: no column {column!r}; columns: {', '.join(labels)}")
    if mtz.column_with_label(column).type != "F":
        raise InputError(f"{path}: column {column!r} is of MTZ type {mtz.column_with_label(column).type!r}, "
                         f"not an amplitude (type F: {', '.join(f_columns) or 'none'})")
    data = np.array(mtz, copy=False)
    indices = data[:, :3]
    if not np.all(np.isfinite(indices) & (np.abs(indices) < 2**31)) or np.any(indices != np.round(indices)):
        raise InputError(f"{path}: damaged structure-factor file (Miller indices H K L are not all integers)")
    hkl = indices.astype(np.int64)
    F = data[:, labels.index(column)].astype(np.float64)
    return _finish(path, gemmi, mtz.spacegroup, mtz.cell, hkl, F, f"column {column} of an MTZ file")


def _read_cif_reflections(path: str, gemmi, doc, column: str | None) -> ReferenceAmplitudes:
    blocks = gemmi.as_refln_blocks(doc)
    if not blocks:
        raise InputError(f"{path}: no reflection block (_refln loop) in the mmCIF file")
    rb = blocks[0]
    labels = list(rb.column_labels())
    if column is None:
        column = next((c for c in _CIF_F_COLUMNS if c in labels), None)
        if column is None:
            raise InputError(f"{path}: no amplitude column ({', '.join(_CIF_F_COLUMNS)}); give one with -hkl_column; "
                             f"columns: {', '.join(labels)}")
    if column not in labels:
        raise InputError(f"{path}: no column {column!r}; columns: {', '.join(labels)}")
    hkl = np.asarray(rb.make_miller_array(), dtype=np.int64)
    F = np.asarray(rb.make_float_array(column), dtype=np.float64)
    return _finish(path, gemmi, rb.spacegroup, rb.cell, hkl, F, f"column {column} of an mmCIF reflection file")


def _model_amplitudes(path: str, gemmi, structure, dmin_A: float | None) -> ReferenceAmplitudes:
    if dmin_A is None or not (math.isfinite(dmin_A) and dmin_A > 0):
        raise InputError(f"{path}: a model needs a resolution limit to compute structure factors to (-hkl_dmin)")
    spacegroup = structure.find_spacegroup()
    if spacegroup is None:
        raise InputError(f"{path}: no space group (CRYST1 / _symmetry) in the model")
    if len(structure) == 0 or structure[0].count_atom_sites() == 0:
        raise InputError(f"{path}: no atoms in the model")
    structure.setup_entities()
    model = structure[0]
    hkl = np.asarray(gemmi.make_miller_array(structure.cell, spacegroup, dmin_A), dtype=np.int64)
    if len(hkl) > 2_000_000:
        raise InputError(f"{path}: {len(hkl)} unique reflections to {dmin_A:g} A; raise -hkl_dmin")
    calc = gemmi.StructureFactorCalculatorX(structure.cell)
    F = np.fromiter((abs(calc.calculate_sf_from_model(model, [int(h), int(k), int(l)])) for h, k, l in hkl),
                    dtype=np.float64, count=len(hkl))
    what = f"|F_calc| of the model ({model.count_atom_sites()} atoms) to {dmin_A:.3g} A"
    return _finish(path, gemmi, spacegroup, structure.cell, hkl, F, what)


def read_reflection_file(path: str | os.PathLike[str], *, column: str | None = None,
                         dmin_A: float | None = None) -> ReferenceAmplitudes:
    """Amplitudes of an MTZ, mmCIF (reflections or model) or PDB file, expanded to P1 (module docstring).

    ``column``: the amplitude column (MTZ, mmCIF reflections); ``dmin_A``: resolution limit (Å) of the
    amplitudes computed from a model (ignored for reflection files, which keep all they list).
    """
    name = str(path)
    if not Path(name).is_file():
        raise InputError(f"{name}: structure-factor file not found")
    gemmi = _gemmi(name)
    try:
        return _read_any(name, gemmi, column, dmin_A)
    except InputError:
        raise
    except (RuntimeError, ValueError, IndexError, OverflowError) as exc:
        # a damaged file that gemmi opened: undecodable labels (UnicodeDecodeError), bad records ...
        lines = str(exc).strip().splitlines()
        raise InputError(f"{name}: damaged structure-factor file ({type(exc).__name__}: "
                         f"{lines[0] if lines else 'no detail'})") from None


def _read_any(name: str, gemmi, column: str | None, dmin_A: float | None) -> ReferenceAmplitudes:
    lower = name.lower()
    if lower.endswith(_MTZ):
        return _read_mtz(name, gemmi, column)
    if lower.endswith(_MODEL):
        try:
            structure = gemmi.read_structure(name)
        except (RuntimeError, ValueError, OSError) as exc:
            raise InputError(f"{name}: not a readable PDB file ({exc})") from None
        return _model_amplitudes(name, gemmi, structure, dmin_A)
    try:
        doc = gemmi.cif.read(name)
    except (RuntimeError, ValueError, OSError) as exc:
        raise InputError(f"{name}: not a readable mmCIF file ({exc})") from None
    if any(block.find_mmcif_category("_atom_site.") for block in doc) and not gemmi.as_refln_blocks(doc):
        if column is not None:
            raise InputError(f"{name}: -hkl_column {column}: the file is a model, not a reflection file")
        return _model_amplitudes(name, gemmi, gemmi.make_structure_from_block(doc.sole_block()), dmin_A)
    return _read_cif_reflections(name, gemmi, doc, column)
