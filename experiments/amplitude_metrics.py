"""How close an amplitude table is to the truth: R and CC after one overall scale, and the anomalous differences.

:func:`compare` takes any table ``key -> F`` (a merge, the refined amplitudes) and the true table on the same keys
(:mod:`experiments.reflection_keys`), over the keys both hold:

* ``scale``: the least-squares overall scale ``k = sum F F_true / sum F^2`` (a merge or a refinement fixes no
  absolute level);
* ``R = sum |k F - F_true| / sum F_true``;
* ``CC``: Pearson's correlation of ``F`` with ``F_true`` (scale-free).

:func:`anomalous_cc`: Pearson's correlation of ``F(+) - F(-)`` with the truth's, over the pairs ``(plus, minus)``
both mates of which the table holds, after the same overall scale (all pairs, and the pairs with a true
difference).
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

__all__ = ["compare", "anomalous_cc", "pearson"]

Key = tuple[int, int, int]


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's correlation (NaN for fewer than 3 values or no spread)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def compare(table: dict[Key, float], truth: dict[Key, float]) -> dict:
    """``{n, scale, R, CC}`` of ``table`` against ``truth`` over their common keys (module docstring)."""
    common = sorted(set(table) & set(truth))
    F = np.array([table[k] for k in common], dtype=np.float64)
    T = np.array([truth[k] for k in common], dtype=np.float64)
    if len(common) == 0 or not np.any(F > 0):
        return {"n": len(common), "scale": math.nan, "R": math.nan, "CC": math.nan}
    k = float(F @ T / (F @ F))
    return {"n": len(common), "scale": k, "R": float(np.abs(k * F - T).sum() / T.sum()), "CC": pearson(F, T)}


def anomalous_cc(table: dict[Key, float], truth: dict[Key, float], pairs: Iterable[tuple[Key, Key]],
                 signal: Iterable[Key] = ()) -> dict:
    """``{n_pairs, CC, n_signal, CC_signal}``: the anomalous differences of ``table`` against ``truth``'s, over the
    ``pairs`` both of whose mates ``table`` holds, and over those whose plus key is in ``signal``."""
    signal = set(signal)
    both = [(p, m) for p, m in pairs if p in table and m in table and p in truth and m in truth]
    k = compare(table, truth)["scale"]
    d = np.array([k * (table[p] - table[m]) for p, m in both])
    t = np.array([truth[p] - truth[m] for p, m in both])
    on = np.array([p in signal for p, _ in both], dtype=bool)
    return {"n_pairs": len(both), "CC": pearson(d, t), "n_signal": int(on.sum()),
            "CC_signal": pearson(d[on], t[on]) if len(both) else math.nan}
