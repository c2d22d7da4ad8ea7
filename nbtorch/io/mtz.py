"""MTZ reflection files written with gemmi (:func:`write_mtz`).

One dataset holds ``H K L`` (type ``H``) and the columns given, each with its MTZ type (``F`` amplitude, ``Q``
standard deviation, ``G``/``L`` an anomalous amplitude and its deviation, ``D`` an anomalous difference, ``I``
an integer); a NaN is MTZ's missing-number flag.  The file is written atomically (:mod:`nbtorch.io.atomic`):
complete or not at all.  gemmi is an optional extra (``pip install 'nbtorch[formats]'``), imported when a file
is written.  This module does not import torch (an ``io`` rule).
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_output_path

__all__ = ["write_mtz", "MTZ_TYPES"]

#: the column types :func:`write_mtz` takes
MTZ_TYPES = ("F", "Q", "G", "L", "D", "I", "J")


def write_mtz(path: str | os.PathLike[str], hkl: np.ndarray, columns: Mapping[str, tuple[str, Sequence[float]]],
              space_group: str, cell: Sequence[float], *, dataset: str = "nbtorch", title: str = "") -> None:
    """Write ``path``: reflections ``hkl`` (n, 3) with ``columns`` (label -> (MTZ type, n values)), the
    ``space_group`` (a symbol gemmi knows) and ``cell`` (a, b, c in Å, alpha, beta, gamma in degrees)."""
    try:
        import gemmi
    except ImportError:
        raise InputError(f"{path}: writing an MTZ file needs gemmi: pip install 'nbtorch[formats]'") from None
    hkl = np.asarray(hkl, dtype=np.int64).reshape(-1, 3)
    group = gemmi.find_spacegroup_by_name(str(space_group))
    if group is None:
        raise InputError(f"{path}: unknown space group {space_group!r}")
    if len(cell) != 6 or not all(np.isfinite(float(x)) and float(x) > 0 for x in cell):
        raise InputError(f"{path}: the cell must be six positive numbers, got {list(cell)}")
    mtz = gemmi.Mtz(with_base=True)
    mtz.title = title or "nbtorch"
    mtz.spacegroup = group
    mtz.set_cell_for_all(gemmi.UnitCell(*(float(x) for x in cell)))
    mtz.add_dataset(dataset)
    data = [hkl.astype(np.float32)]
    for label, (kind, values) in columns.items():
        if kind not in MTZ_TYPES:
            raise InputError(f"{path}: column {label}: MTZ type {kind!r} is not one of {', '.join(MTZ_TYPES)}")
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.size != len(hkl):
            raise InputError(f"{path}: column {label} has {values.size} values for {len(hkl)} reflections")
        mtz.add_column(label, kind)
        data.append(values.astype(np.float32)[:, None])
    mtz.set_data(np.hstack([data[0]] + data[1:]) if len(hkl) else np.zeros((0, 3 + len(columns)), np.float32))
    mtz.update_reso()
    with atomic_output_path(path) as tmp:
        mtz.write_to_file(str(tmp))
