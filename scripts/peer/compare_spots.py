"""DIALS's spot residuals beside nbtorch's on the same spots (issue 33, item 6; opt-in, never run by CI).

    .venv/bin/python scripts/peer/compare_spots.py DIALS_INDEXED.refl RESULT.json [--radius PX]

DIALS_INDEXED.refl: the reflections DIALS refined (``dials.stills_process``' ``idx-*_indexed.refl``, with
``xyzobs.px.value`` and ``xyzcal.px``; rows flagged ``used_in_refinement`` when the column has flags).
RESULT.json: ``nbtorch-refine``'s result on the same image (its ``spots``: observed and final predicted
positions).  A spot is shared when DIALS's observed centroid lies within ``--radius`` px (default 1.5) of
nbtorch's observed one (each DIALS spot used once, nearest first).  Prints, for the shared spots and for each
program's own spots, the number and the rms distance (px) between observed and predicted positions.  Both
programs and ``nbtorch.io.dials.read_refl`` take pixel ``i`` to cover ``[i, i + 1)``.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.dials import read_refl

USED_IN_REFINEMENT = 1 << 3  # DIALS reflection_table flag


def _rms(d: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.sum(d * d, axis=1)))) if len(d) else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("refl")
    ap.add_argument("result")
    ap.add_argument("--radius", type=float, default=1.5, help="px; DIALS and nbtorch centroids closer are one spot")
    a = ap.parse_args(argv)
    try:
        refl = read_refl(a.refl, ("xyzobs.px.value", "xyzcal.px"), optional=("flags",))
    except InputError as exc:
        print(f"compare_spots: {exc}", file=sys.stderr)
        return 2
    keep = np.ones(len(refl["xyzobs.px.value"]), dtype=bool)
    if "flags" in refl:
        keep = (refl["flags"].astype(np.int64) & USED_IN_REFINEMENT) != 0
    d_obs, d_cal = refl["xyzobs.px.value"][keep, :2], refl["xyzcal.px"][keep, :2]
    try:
        spots = json.load(open(a.result))["spots"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"compare_spots: {a.result}: no nbtorch spots ({exc})", file=sys.stderr)
        return 2
    # x, y only: spots from a .refl carry their frame z as a third column
    n_obs = np.asarray(spots["observed"], dtype=float).reshape(len(spots["observed"]), -1)[:, :2]
    n_cal = np.asarray([p[:2] if p[0] is not None else [np.nan, np.nan] for p in spots["predicted_final"]],
                       dtype=float).reshape(-1, 2)
    mine = np.all(np.isfinite(n_cal), axis=1)

    dist = np.linalg.norm(n_obs[:, None, :] - d_obs[None, :, :], axis=2)
    pairs, used_n, used_d = [], set(), set()
    for flat in np.argsort(dist, axis=None):
        i, j = np.unravel_index(flat, dist.shape)
        if dist[i, j] > a.radius:
            break
        if i in used_n or j in used_d or not mine[i]:
            continue
        used_n.add(i)
        used_d.add(j)
        pairs.append((i, j))
    ni = np.array([p[0] for p in pairs], dtype=int)
    dj = np.array([p[1] for p in pairs], dtype=int)
    rows = [
        ("DIALS, all its refined spots", len(d_obs), _rms(d_obs - d_cal)),
        ("nbtorch, all its matched spots", int(mine.sum()), _rms((n_obs - n_cal)[mine])),
        ("DIALS, shared spots", len(pairs), _rms(d_obs[dj] - d_cal[dj]) if len(pairs) else float("nan")),
        ("nbtorch, shared spots", len(pairs), _rms(n_obs[ni] - n_cal[ni]) if len(pairs) else float("nan")),
    ]
    print(f"| spots (match radius {a.radius:g} px) | n | rms obs - predicted (px) |")
    print("|---|---|---|")
    for name, n, rms in rows:
        print(f"| {name} | {n} | {rms:.3f} |")
    if len(pairs):
        shift = np.mean(n_obs[ni] - d_obs[dj], axis=0)
        print(f"\nmean observed-centroid difference nbtorch - DIALS on shared spots: {shift[0]:+.3f}, {shift[1]:+.3f} px "
              f"(rms {_rms(n_obs[ni] - d_obs[dj]):.3f} px)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
