"""Several DIALS ``.expt``/``.refl`` pairs of stills as one set::

    nbtorch-refine --expt 'out/idx-*_refined.expt' --refl 'out/idx-*_indexed.refl' --joint --out-dir out/all
    nbtorch-refine --expt a.expt b.expt --refl a.refl b.refl --out-dir out/stills

``dials.stills_process`` without composite output leaves one pair a still; a composite run leaves one pair a
batch.  ``--expt`` and ``--refl`` each take paths and glob patterns (``*``, ``?``, ``[``; each expanded in name
order), and the ``i``-th ``.expt`` goes with the ``i``-th ``.refl``.  One pair is the one file of
:mod:`refine.many.dials_stills`; several are one set of stills: every experiment of every pair, in pair order then
experiment order (:func:`refine.many.dials_stills.pairs_stills`).  :func:`dials_pairs` expands and checks them
before any work: a pattern that matches nothing, different counts of ``.expt`` and ``.refl`` files, a file that is
not there or a pair given twice is one line (an :class:`~nbtorch.errors.InputError`).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Sequence

from nbtorch.errors import InputError

__all__ = ["Pair", "expand_paths", "matching", "path_count", "dials_pairs", "ONE_EXPERIMENT_OPTIONS", "refuse_with_pairs"]

#: the options of one experiment (flag, field name), refused with several pairs
ONE_EXPERIMENT_OPTIONS = (("--image", "image"), ("--expt-index", "expt_index"), ("--expt-image", "expt_image"),
                          ("--problem", "problem"), ("--rotation-series", "rotation_series"))

#: one ``.expt`` and its ``.refl``
Pair = tuple[str, str]


def expand_paths(flag: str, items: str | Sequence[str] | None) -> list[str]:
    """``items`` (a path, or several) with each glob pattern replaced by the files it matches, in name order (a path
    that exists is itself, whatever its characters).

    Raises:
        InputError: a pattern that matches no file.
    """
    if items is None:
        return []
    out: list[str] = []
    for item in [items] if isinstance(items, (str, os.PathLike)) else items:
        item = os.fspath(item)
        out.extend(matching(item, flag) if glob.has_magic(item) and not os.path.exists(item) else [item])
    return out


def matching(pattern: str, flag: str) -> list[str]:
    """The files ``pattern`` matches, in name order.

    Raises:
        InputError: ``flag pattern: no file matches the pattern``.
    """
    matches = sorted(glob.glob(pattern))
    if not matches:
        raise InputError(f"{flag} {pattern}: no file matches the pattern")
    return matches


def path_count(items: Sequence[str] | None) -> int:
    """How many files ``items`` name, each pattern counted by its matches (at least 1: nothing refused here)."""
    return sum(max(1, len(glob.glob(i))) if glob.has_magic(i) and not os.path.exists(i) else 1 for i in items or ())


def _check_pairs(expts: list[str], refls: list[str]) -> None:
    """Several pairs: as many ``.refl`` as ``.expt`` files, each there and each pair once."""
    if len(expts) != len(refls):
        raise InputError(f"--expt/--refl: {len(expts)} .expt files and {len(refls)} .refl files; give one .refl "
                         "per .expt, paired in order")
    for flag, paths in (("--expt", expts), ("--refl", refls)):
        for path in paths:
            if not Path(path).is_file():
                raise InputError(f"{flag} {path}: file not found")
    seen: set[Pair] = set()
    for pair in zip(expts, refls):
        key = (os.path.realpath(pair[0]), os.path.realpath(pair[1]))
        if key in seen:
            raise InputError(f"--expt {pair[0]} --refl {pair[1]}: the pair is given twice")
        seen.add(key)


def dials_pairs(expts: str | Sequence[str] | None, refls: str | Sequence[str] | None
                ) -> tuple[str | None, str | None, tuple[Pair, ...]]:
    """``(expt, refl, more)``: the first ``.expt`` and ``.refl`` (None: none given) and the pairs after them (empty:
    one pair, or an ``.expt`` alone), globs expanded (:func:`expand_paths`; module docstring).

    Raises:
        InputError: a glob that matches nothing; with several pairs, different counts, a missing file, a pair twice.
    """
    e, r = expand_paths("--expt", expts), expand_paths("--refl", refls)
    if len(e) <= 1 and len(r) <= 1:
        return (e[0] if e else None), (r[0] if r else None), ()
    _check_pairs(e, r)
    return e[0], r[0], tuple(zip(e[1:], r[1:]))


def refuse_with_pairs(values: dict) -> None:
    """Several pairs: none of :data:`ONE_EXPERIMENT_OPTIONS` given (``values``: field name -> value; None, False
    or absent: not given).

    Raises:
        InputError: the first given, in one line.
    """
    for flag, name in ONE_EXPERIMENT_OPTIONS:
        value = values.get(name)
        if value is not None and value is not False:  # 0 (--expt-index 0) is given
            raise InputError(f"{flag}: not with several --expt/--refl pairs (every experiment of every pair is a "
                             "still, refined from the image it names)")
