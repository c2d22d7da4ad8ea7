"""Which amplitude a Miller index belongs to, for the synthetic amplitude sets and the merges that measure them.

A reflection ``(h k l)`` is named by its reflection in gemmi's reciprocal asymmetric unit of the space group
(``key``), by the rule that names the refined amplitudes ``F_h_k_l``
(:func:`refine.fitting.structure_factors.asu_reflection`):

* **tied** (``anomalous=False``): every symmetry equivalent and Friedel mate has the key of the asymmetric-unit
  reflection;
* **anomalous** (``anomalous=True``): an acentric reflection whose equivalent in the asymmetric unit is reached
  without the Friedel flip (gemmi's ``isym`` odd) is F(+), keyed by the asymmetric-unit reflection; one reached
  with it is F(-), keyed by its negative ``-(key)`` (the refinement's name of F(-)); a centric reflection keeps
  the asymmetric-unit key.

Keys are tuples of three ints; indices are the Miller indices of the simulator's cell.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from nbtorch.errors import InputError
from refine.fitting.structure_factors import asu_reflection

__all__ = ["reflection_key", "reflection_keys", "is_centric", "is_absent", "hm_symbol"]

Key = tuple[int, int, int]


@lru_cache(maxsize=8)
def _group(space_group: str):
    try:
        import gemmi  # noqa: PLC0415 - optional extra ('nbtorch[formats]')
    except ImportError:
        raise InputError("synthetic amplitude sets need gemmi (space groups): pip install 'nbtorch[formats]'") from None
    try:
        group = gemmi.SpaceGroup(space_group)
    except (ValueError, RuntimeError):
        raise InputError(f"space group: unknown symbol {space_group!r}") from None
    return group, group.operations(), gemmi.ReciprocalAsu(group)


def hm_symbol(space_group: str) -> str:
    """The Hermann-Mauguin symbol gemmi gives ``space_group`` (an unknown one: one error line)."""
    return _group(space_group)[0].hm


@lru_cache(maxsize=1 << 18)
def reflection_key(space_group: str, hkl: Key, anomalous: bool) -> Key:
    """The key of one reflection (module docstring)."""
    _, ops, asu = _group(space_group)
    key, sign = asu_reflection(ops, asu, hkl, anomalous)
    return (-key[0], -key[1], -key[2]) if sign < 0 else key


def reflection_keys(space_group: str, hkl: np.ndarray, anomalous: bool) -> list[Key]:
    """The keys of the (n, 3) Miller indices ``hkl``."""
    return [reflection_key(space_group, (int(h), int(k), int(l)), bool(anomalous)) for h, k, l in np.asarray(hkl)]  # noqa: E741


def is_centric(space_group: str, key: Key) -> bool:
    """Whether the reflection ``key`` is centric (its Friedel mate is a symmetry equivalent)."""
    return bool(_group(space_group)[1].is_reflection_centric(list(key)))


def is_absent(space_group: str, key: Key) -> bool:
    """Whether ``key`` is systematically absent in the space group."""
    return bool(_group(space_group)[1].is_systematically_absent(list(key)))
