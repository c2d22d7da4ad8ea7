"""The refined amplitudes as an MTZ file (``nbtorch-refine --structure-factors --mtz-out FILE``) and the anomalous
pairs of a result (:func:`anomalous_rows`).

One row per reflection of the reciprocal asymmetric unit whose amplitude was refined (held candidates are left
out), with the run's space group and refined cell:

============  ====  ==========================================================================================
column        type  value
============  ====  ==========================================================================================
H K L         H     the reflection (gemmi's asymmetric unit; the simulator's indices)
F, SIGF       F Q   the amplitude and its esd (NaN, MTZ's missing number, without esds); anomalous: the mean of
                    F(+) and F(-) and its esd
NOBS          I     the images on whose fitted pixels the amplitude puts at least 1 % of ``--f-min-photons``
                    Bragg photons (a single run: 1)
F(+) SIGF(+)  G L   anomalous runs: F of (h k l) and its equivalents; a centric reflection's one amplitude
F(-) SIGF(-)  G L   anomalous runs: F of -(h k l) and its equivalents (the same for a centric one)
DANO SIGDANO  D Q   anomalous runs: F(+) - F(-) and ``sqrt(SIGF(+)^2 + SIGF(-)^2)`` (their correlation left out);
                    missing for a centric reflection or where one of the pair is not refined
============  ====  ==========================================================================================
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from nbtorch.io.mtz import write_mtz
from refine.fitting.structure_factors import amplitude_name

__all__ = ["write_amplitude_mtz", "anomalous_rows", "mtz_columns", "amplitude_notes", "ANOMALOUS_COLUMNS"]

#: the columns of a result's ``anomalous`` rows
ANOMALOUS_COLUMNS = ["h", "k", "l", "F_plus", "esd_plus", "F_minus", "esd_minus", "dano", "sigdano"]
_CELL = ("cell_a", "cell_b", "cell_c", "cell_alpha", "cell_beta", "cell_gamma")


def _esd(esds: Mapping[str, float], name: str) -> float:
    e = esds.get(name)
    return math.nan if e is None or not math.isfinite(float(e)) else float(e)


def anomalous_rows(table, values: Mapping[str, float], esds: Mapping[str, float], free) -> dict:
    """``{"columns", "rows"}``: one row ``[h, k, l, F+, esd+, F-, esd-, dano, sigdano]`` per anomalous pair of
    ``table`` whose two amplitudes are refined (esds None where unknown)."""
    free, rows = set(free), []
    for i, j in table.pairs():
        a, b = table.names[i], table.names[j]
        if a not in free or b not in free:
            continue
        fp, fm = float(values.get(a, table.starts[a])), float(values.get(b, table.starts[b]))
        sp, sm = _esd(esds, a), _esd(esds, b)
        sd = math.hypot(sp, sm)
        rows.append([*(int(x) for x in table.hkl[i]), fp, None if math.isnan(sp) else sp, fm,
                     None if math.isnan(sm) else sm, fp - fm, None if math.isnan(sd) else sd])
    return {"columns": list(ANOMALOUS_COLUMNS), "rows": rows}


def mtz_columns(table, values: Mapping[str, float], esds: Mapping[str, float], free,
                nobs=None, nobs_pair=None) -> tuple[np.ndarray, dict]:
    """``(hkl (m, 3), label -> (MTZ type, m values))`` of the module docstring; ``nobs``/``nobs_pair``: (A,) per
    candidate (:func:`refine.many.amplitudes.observing_images`), None: 1 each."""
    free = set(free)
    A = len(table.names)
    nobs = np.ones(A, dtype=np.int64) if nobs is None else np.asarray(nobs)
    nobs_pair = nobs if nobs_pair is None else np.asarray(nobs_pair)
    refs: dict[tuple, dict] = {}  # asu reflection -> sign -> candidate index
    for i, (h, s) in enumerate(zip(table.hkl, table.signs)):
        if table.names[i] in free:
            refs.setdefault(tuple(int(x) * (-1 if s < 0 else 1) for x in h), {})[int(s)] = i
    keys = sorted(refs)
    F = {k: np.full(len(keys), math.nan) for k in ("F", "SIGF", "F(+)", "SIGF(+)", "F(-)", "SIGF(-)", "DANO",
                                                     "SIGDANO", "NOBS")}
    for r, key in enumerate(keys):
        member = refs[key]
        val = {s: float(values.get(table.names[i], table.starts[table.names[i]])) for s, i in member.items()}
        err = {s: _esd(esds, table.names[i]) for s, i in member.items()}
        F["NOBS"][r] = max(nobs_pair[i] for i in member.values())
        if 0 in member:  # Friedel mates tied (or a centric reflection)
            F["F"][r] = F["F(+)"][r] = F["F(-)"][r] = val[0]
            F["SIGF"][r] = F["SIGF(+)"][r] = F["SIGF(-)"][r] = err[0]
            continue
        for s, label in ((1, "(+)"), (-1, "(-)")):
            if s in member:
                F["F" + label][r], F["SIGF" + label][r] = val[s], err[s]
        if len(member) == 2:
            F["F"][r], F["SIGF"][r] = 0.5 * (val[1] + val[-1]), 0.5 * math.hypot(err[1], err[-1])
            F["DANO"][r], F["SIGDANO"][r] = val[1] - val[-1], math.hypot(err[1], err[-1])
        else:
            (s,) = member
            F["F"][r], F["SIGF"][r] = val[s], err[s]
    types = {"F": "F", "SIGF": "Q", "NOBS": "I"}
    if table.anomalous:
        types.update({"F(+)": "G", "SIGF(+)": "L", "F(-)": "G", "SIGF(-)": "L", "DANO": "D", "SIGDANO": "Q"})
    hkl = np.array(keys, dtype=np.int64).reshape(-1, 3)
    return hkl, {label: (kind, F[label]) for label, kind in types.items()}


def amplitude_notes(sf: dict, no_esds: bool, mtz_path: str | None) -> list[str]:
    """The printed lines on the anomalous pairs of a result's ``structure_factors`` and on an MTZ without esds."""
    lines = []
    if "anomalous" in sf:
        dano = [r[7] for r in sf["anomalous"]["rows"]]
        lines.append(f"anomalous pairs: {len(dano)} with both F(+) and F(-) refined" + (
            f"; F(+) - F(-) from {min(dano):.4g} to {max(dano):.4g}, {sum(d > 0 for d in dano)} positive" if dano else ""))
    if mtz_path is not None and no_esds:
        lines.append(f"{mtz_path}: SIGF (and SIGDANO) missing: the run computed no esds (--no-esds)")
    return lines


def write_amplitude_mtz(path, result) -> int:
    """Write ``path`` from a single run's or a joint run's result (its amplitudes, esds, space group and refined
    cell; a joint run's ``nobs`` from its ``structure_factors``); the number of reflections written."""
    table = getattr(result, "amplitude_table", None) or result.amplitudes
    images = getattr(result, "images", None)
    params = {**(images[0] if images else {}), **result.params}
    sf = result.structure_factors() if callable(result.structure_factors) else result.structure_factors
    # the rows carry each amplitude's value and esd (a joint result keeps the amplitudes' esds only there)
    values = {amplitude_name(row[:3]): row[4] for row in sf["reflections"]}
    esds = {amplitude_name(row[:3]): row[5] for row in sf["reflections"] if row[5] is not None}
    free = [amplitude_name(row[:3]) for row in sf["reflections"] if row[6]]
    hkl, columns = mtz_columns(table, values, esds, free, sf.get("nobs"), sf.get("nobs_pair"))
    write_mtz(path, hkl, columns, table.space_group, [float(params[n]) for n in _CELL],
              title="nbtorch-refine structure factors")
    return len(hkl)
