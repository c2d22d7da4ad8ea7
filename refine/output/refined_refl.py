"""``OUT_DIR/refined.refl``: the reflections of a DIALS file of stills with nbtorch's refined predictions, for the
next program (dxtbx and DIALS read it as any reflection table).

Each refined still contributes the rows of its experiment that it fitted as observed spots (those
:func:`refine.inputs.dials.observed_rows` keeps whose centroid is one of the still's spots: the ``spots`` of its
``result.json``), in the ``.refl``'s order:

* ``xyzcal.px`` is the refined model's spot centroid (x, y px; z the observed one, a still's frame), where the
  model has a spot within the search radius of the observed one; rows without one are left out;
* the columns that hold DIALS's own prediction from its own model (``xyzcal.mm``, ``s1``, ``delpsical.rad``, ``rlp``,
  ``d``, ``partiality``, ``zeta``) are left out rather than written stale;
* every other column (``id``, ``miller_index``, ``flags``, ``xyzobs.*``, ``intensity.*``, ``bbox``, ``panel`` ...) as
  the input has it; the identifiers map as the input's, so ``id`` names the same experiment of ``refined.expt``.

Columns of types that :data:`nbtorch.io.dials.REFL_TYPES` does not hold (shoeboxes) are not copied.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.dials import refl_table, write_refl
from refine.inputs.dials import observed_rows

__all__ = ["STALE_COLUMNS", "refined_reflections", "write_refined_refl", "write_refined_refls"]

log = logging.getLogger(__name__)

#: DIALS's prediction from its own model: not written beside nbtorch's
STALE_COLUMNS = ("xyzcal.mm", "s1", "delpsical.rad", "rlp", "d", "partiality", "zeta")


def refined_reflections(refl: str, spots: Mapping[int, tuple[np.ndarray, np.ndarray]]
                        ) -> tuple[dict, dict[int, str], dict[int, int]]:
    """``(columns, identifiers, rows per experiment)`` of ``refined.refl``: for each experiment ``k`` of ``spots``
    (``(observed, predicted)``: its fitted spots' observed x, y px and their refined predictions, NaN where none), the
    rows of experiment ``k`` whose observed centroid is one of them, with its prediction (module docstring).

    Raises:
        InputError: ``refl`` unreadable or without ``xyzobs.px.value`` and ``id``.
    """
    columns, identifiers = refl_table(refl)
    if "xyzobs.px.value" not in columns or "id" not in columns:
        raise InputError(f"{refl}: no 'xyzobs.px.value' or 'id' column")
    xyz, ids = columns["xyzobs.px.value"][1], columns["id"][1]
    observed = observed_rows(refl, {"xyzobs.px.value": xyz, "flags": columns.get("flags", (None, None))[1]})
    take, cal, counts = [], [], {}
    for k in sorted(spots):
        obs = np.asarray(spots[k][0], dtype=np.float64).reshape(len(spots[k][0]), -1)[:, :2]
        pred = np.asarray(spots[k][1], dtype=np.float64).reshape(-1, 2)
        where = {(float(x), float(y)): j for j, (x, y) in enumerate(obs)}
        rows, got = [], []
        for r in np.flatnonzero(observed & (ids == k)):
            j = where.get((float(xyz[r, 0]), float(xyz[r, 1])))
            if j is not None and np.isfinite(pred[j]).all():
                rows.append(r)
                got.append((pred[j, 0], pred[j, 1], xyz[r, 2]))
        take.append(np.asarray(rows, dtype=np.int64))
        cal.append(np.asarray(got, dtype=np.float64).reshape(-1, 3))
        counts[k] = len(rows)
    take_all = np.concatenate(take) if take else np.zeros(0, dtype=np.int64)
    out = {name: (kind, arr[take_all]) for name, (kind, arr) in columns.items() if name not in STALE_COLUMNS}
    out["xyzcal.px"] = ("vec3<double>", np.concatenate(cal) if cal else np.zeros((0, 3)))
    return out, identifiers, counts


def write_refined_refl(refl: str, spots: Mapping[int, tuple[np.ndarray, np.ndarray]], path: str | Path
                       ) -> dict[int, int]:
    """Write :func:`refined_reflections` to ``path`` (atomic); the rows written per experiment."""
    columns, identifiers, counts = refined_reflections(refl, spots)
    write_refl(path, columns, identifiers)
    log.info("%s: %d reflections of %d stills with refined predictions", path, sum(counts.values()), len(counts))
    return counts


def write_refined_refls(refls: Sequence[str], firsts: Sequence[int],
                        spots: Mapping[tuple[int, int], tuple[np.ndarray, np.ndarray]], path: str | Path
                        ) -> dict[int, int]:
    """Write the refined reflections of several ``.refl`` files as one table to ``path`` (atomic): each file's rows
    (:func:`refined_reflections` of its experiments in ``spots``, keyed ``(file, experiment)``), in file order, ``id``
    and the identifiers renumbered to the experiments together (``firsts``: the place of each file's first); the
    columns every file has with one type.  One file: :func:`write_refined_refl`.  The rows written per experiment
    (renumbered)."""
    if len(refls) == 1:
        return write_refined_refl(refls[0], {k: v for (_, k), v in spots.items()}, path)
    tables, identifiers, counts = [], {}, {}
    for j, refl in enumerate(refls):
        columns, ids, rows = refined_reflections(refl, {k: v for (p, k), v in spots.items() if p == j})
        kind, arr = columns["id"]
        columns["id"] = (kind, arr + firsts[j])
        identifiers.update({k + firsts[j]: v for k, v in ids.items()})
        counts.update({k + firsts[j]: n for k, n in rows.items()})
        tables.append(columns)
    names = [n for n, (kind, _) in tables[0].items() if all(t.get(n, ("",))[0] == kind for t in tables)]
    write_refl(path, {n: (tables[0][n][0], np.concatenate([t[n][1] for t in tables])) for n in names}, identifiers)
    log.info("%s: %d reflections of %d stills of %d files with refined predictions", path, sum(counts.values()),
             len(counts), len(refls))
    return counts
