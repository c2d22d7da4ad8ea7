"""DIALS's spot residuals beside nbtorch's on the same spots, per still (opt-in, never run by CI).

    .venv/bin/python scripts/peer/compare_spots.py DIALS_INDEXED.refl RESULT.json [--id K] [--radius PX]
    .venv/bin/python scripts/peer/compare_spots.py DIALS_COMPOSITE.refl OUT_DIR [--radius PX]
    .venv/bin/python scripts/peer/compare_spots.py DIALS_COMPOSITE.refl OUT_DIR/refined.refl [--radius PX]

DIALS_INDEXED.refl: the reflections DIALS refined (``dials.stills_process``' ``idx-*_indexed.refl``, one still or a
composite file of many, with ``xyzobs.px.value`` and ``xyzcal.px``; rows flagged ``used_in_refinement`` when the
column has flags).  RESULT.json: ``nbtorch-refine``'s result on one image (its ``spots``: observed and final
predicted positions); its rows of the ``.refl`` are those of ``--id K``, else of the experiment the result records
(``input.expt_index``, a run from ``--expt``), else all.  OUT_DIR: independent mode's folder over the stills of a
DIALS file (``nbtorch-refine --expt --refl --out-dir``): every ``OUT_DIR/*/result.json`` against its experiment's
rows.  OUT_DIR/refined.refl: the combined output of either mode (``--joint`` too), each experiment's rows against
DIALS's rows of the same ``id``.  A spot is shared when DIALS's observed centroid lies within ``--radius`` px (default 1.5) of nbtorch's
observed one (each DIALS spot used once, nearest first).  Prints, per still and over all, for the shared spots and
for each program's own spots, the number and the rms distance (px) between observed and predicted positions.  Both
programs and ``nbtorch.io.dials.read_refl`` take pixel ``i`` to cover ``[i, i + 1)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.dials import read_refl

USED_IN_REFINEMENT = 1 << 3  # DIALS reflection_table flag


def _rms(d: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.sum(d * d, axis=1)))) if len(d) else float("nan")


def _dials_spots(refl: dict, experiment: int | None) -> tuple[np.ndarray, np.ndarray]:
    """DIALS's observed and predicted (x, y) of the spots it refined, of ``experiment`` when given."""
    keep = np.ones(len(refl["xyzobs.px.value"]), dtype=bool)
    if "flags" in refl:
        keep &= (refl["flags"].astype(np.int64) & USED_IN_REFINEMENT) != 0
    if experiment is not None and "id" in refl:
        keep &= refl["id"] == experiment
    return refl["xyzobs.px.value"][keep, :2], refl["xyzcal.px"][keep, :2]


def _nbtorch_spots(doc: dict) -> tuple[np.ndarray, np.ndarray]:
    """nbtorch's observed (x, y) and final predicted (x, y; NaN where not matched) of a result document."""
    spots = doc["spots"]
    # x, y only: spots from a .refl carry their frame z as a third column
    n_obs = np.asarray(spots["observed"], dtype=float).reshape(len(spots["observed"]), -1)[:, :2]
    n_cal = np.asarray([p[:2] if p[0] is not None else [np.nan, np.nan] for p in spots["predicted_final"]],
                       dtype=float).reshape(-1, 2)
    return n_obs, n_cal


def compare(d_obs, d_cal, n_obs, n_cal, radius: float) -> dict:
    """Both programs' rms (obs - predicted) over their own spots and over the spots they share."""
    mine = np.all(np.isfinite(n_cal), axis=1)
    dist = np.linalg.norm(n_obs[:, None, :] - d_obs[None, :, :], axis=2)
    pairs, used_n, used_d = [], set(), set()
    for flat in np.argsort(dist, axis=None):
        i, j = np.unravel_index(flat, dist.shape)
        if dist[i, j] > radius:
            break
        if i in used_n or j in used_d or not mine[i]:
            continue
        used_n.add(i)
        used_d.add(j)
        pairs.append((i, j))
    ni = np.array([p[0] for p in pairs], dtype=int)
    dj = np.array([p[1] for p in pairs], dtype=int)
    return {"dials_all": (len(d_obs), d_obs - d_cal), "nbtorch_all": (int(mine.sum()), (n_obs - n_cal)[mine]),
            "dials_shared": (len(pairs), d_obs[dj] - d_cal[dj]), "nbtorch_shared": (len(pairs), n_obs[ni] - n_cal[ni]),
            "centroids": n_obs[ni] - d_obs[dj]}


def _table(name_rows, radius: float) -> list[str]:
    lines = [f"| still | DIALS spots | DIALS rms | nbtorch spots | nbtorch rms | shared (radius {radius:g} px) "
             "| DIALS rms, shared | nbtorch rms, shared |", "|---|---|---|---|---|---|---|---|"]
    for name, c in name_rows:
        lines.append(f"| {name} | {c['dials_all'][0]} | {_rms(c['dials_all'][1]):.3f} | {c['nbtorch_all'][0]} | "
                     f"{_rms(c['nbtorch_all'][1]):.3f} | {c['dials_shared'][0]} | {_rms(c['dials_shared'][1]):.3f} | "
                     f"{_rms(c['nbtorch_shared'][1]):.3f} |")
    return lines


def _results(target: Path, experiment: int | None) -> list[tuple[str, dict, int | None]]:
    """``(name, result document, experiment)`` of a result file or of every still of an independent-mode folder."""
    if target.suffix == ".refl":  # nbtorch's refined.refl: each experiment's spots and refined predictions
        cols = read_refl(target, ("xyzobs.px.value", "xyzcal.px", "id"))
        ks = [experiment] if experiment is not None else sorted(int(k) for k in np.unique(cols["id"]))
        return [(f"experiment {k}", {"spots": {"observed": cols["xyzobs.px.value"][cols["id"] == k, :2].tolist(),
                                               "predicted_final": cols["xyzcal.px"][cols["id"] == k, :2].tolist()}}, k)
                for k in ks]
    paths = sorted(target.glob("*/result.json")) if target.is_dir() else [target]
    if not paths:
        raise InputError(f"{target}: no */result.json (give a result.json or an independent-mode --out-dir)")
    out = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            doc["spots"]["observed"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{path}: no nbtorch spots ({exc})") from None
        k = experiment if experiment is not None else (doc.get("input") or {}).get("expt_index")
        out.append((path.parent.name if target.is_dir() else path.name, doc, k))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("refl")
    ap.add_argument("result", help="an nbtorch result.json, an independent-mode --out-dir or its refined.refl")
    ap.add_argument("--id", type=int, default=None, help="the experiment of a result.json (default: its own record)")
    ap.add_argument("--radius", type=float, default=1.5, help="px; DIALS and nbtorch centroids closer are one spot")
    a = ap.parse_args(argv)
    try:
        refl = read_refl(a.refl, ("xyzobs.px.value", "xyzcal.px"), optional=("flags", "id"))
        results = _results(Path(a.result), a.id)
    except InputError as exc:
        print(f"compare_spots: {exc}", file=sys.stderr)
        return 2
    rows = []
    for name, doc, k in results:
        d_obs, d_cal = _dials_spots(refl, k)
        rows.append((name, compare(d_obs, d_cal, *_nbtorch_spots(doc), a.radius)))
    if len(rows) > 1:
        total = {key: (sum(c[key][0] for _, c in rows), np.concatenate([c[key][1] for _, c in rows]))
                 for key in ("dials_all", "nbtorch_all", "dials_shared", "nbtorch_shared")}
        total["centroids"] = np.concatenate([c["centroids"] for _, c in rows])
        rows.append(("all", total))
    print("\n".join(_table(rows, a.radius)))
    cen = rows[-1][1]["centroids"]
    if len(cen):
        shift = np.mean(cen, axis=0)
        print(f"\nmean observed-centroid difference nbtorch - DIALS on shared spots: {shift[0]:+.3f}, {shift[1]:+.3f} px "
              f"(rms {_rms(cen):.3f} px)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
