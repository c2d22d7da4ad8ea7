"""The merges to beat: integrated spots of many stills to one amplitude per symmetry-unique reflection.

Every observation is one integrated spot (:mod:`experiments.spot_integration`) keyed by its reflection
(:mod:`experiments.reflection_keys`, tied or anomalous):

* :func:`merge_plain`, the Monte Carlo merge: ``I_r = mean_i I_ri`` over the observations of reflection ``r``,
  nothing corrected (neither partiality nor a still's scale);
* :func:`merge_partiality`, the mean corrected by the model's partiality: ``I_r = sum_i I_ri / sum_i g_ri`` with
  ``g_ri`` the model's photons per ``F^2`` on the spot's window (partiality, Lorentz and polarisation factors
  and the still's scale): the least-squares estimate of ``I_r`` in ``I_ri = g_ri I_r + noise`` with variance
  proportional to ``g_ri`` (the weighted mean of ``I_ri / g_ri`` with weights ``g_ri``); observations with
  ``g <= 0`` are left out;
* :func:`amplitudes`: ``F = sqrt(max(I, 0))`` (no French-Wilson: a negative mean is F = 0);
* :func:`reference_grid`: a tied table as the dense ``F[h - h_min, k - k_min, l - l_min]`` a model holds
  (:meth:`nbtorch.simulator.Simulator.with_structure_factors`): every index its key's amplitude, ``default`` where
  the table has none, F(000) 0.

Tables are dicts ``key -> value`` (keys: three ints).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np

from experiments.reflection_keys import reflection_key

__all__ = ["merge_plain", "merge_partiality", "amplitudes", "counts", "reference_grid"]

Key = tuple[int, int, int]


def _check(keys: Sequence[Key], *columns: np.ndarray) -> None:
    for c in columns:
        if len(c) != len(keys):
            raise ValueError(f"merge: {len(keys)} keys but a column of {len(c)} values")


def merge_plain(keys: Sequence[Key], intensity: np.ndarray) -> dict[Key, float]:
    """The plain mean of the ``intensity`` (photons) of each key's observations."""
    _check(keys, intensity)
    sums: dict = defaultdict(float)
    n: dict = defaultdict(int)
    for k, i in zip(keys, intensity):
        sums[k] += float(i)
        n[k] += 1
    return {k: sums[k] / n[k] for k in sorted(sums)}


def merge_partiality(keys: Sequence[Key], intensity: np.ndarray, model: np.ndarray) -> dict[Key, float]:
    """``sum I / sum g`` per key (``F^2`` in electrons^2 when ``model`` is photons per ``F^2``); observations with
    ``model <= 0`` are left out."""
    _check(keys, intensity, model)
    top: dict = defaultdict(float)
    bottom: dict = defaultdict(float)
    for k, i, g in zip(keys, intensity, model):
        if g > 0:
            top[k] += float(i)
            bottom[k] += float(g)
    return {k: top[k] / bottom[k] for k in sorted(top)}


def amplitudes(intensities: dict[Key, float]) -> dict[Key, float]:
    """``F = sqrt(max(I, 0))`` of every entry."""
    return {k: float(np.sqrt(max(v, 0.0))) for k, v in intensities.items()}


def counts(keys: Iterable[Key]) -> dict[Key, int]:
    """The number of observations of each key."""
    out: dict = defaultdict(int)
    for k in keys:
        out[k] += 1
    return dict(out)


def reference_grid(table: dict[Key, float], space_group: str, hmax: int, default: float) -> tuple[np.ndarray, np.ndarray]:
    """``(grid (2 hmax + 1,) * 3, hkl_min (3,))``: the tied ``table`` over ``[-hmax, hmax]^3`` (module docstring)."""
    r = range(-int(hmax), int(hmax) + 1)
    grid = np.full((len(r),) * 3, float(default))
    for i, h in enumerate(r):
        for j, k in enumerate(r):
            for m, l in enumerate(r):  # noqa: E741
                grid[i, j, m] = table.get(reflection_key(space_group, (h, k, l), False), default)
    grid[hmax, hmax, hmax] = 0.0
    return grid, np.array([-int(hmax)] * 3)
