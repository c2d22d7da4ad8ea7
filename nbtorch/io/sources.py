"""X-ray source lists (nanoBragg ``-sourcefile``).

Format
    One source per line with up to five numbers ``X Y Z weight lambda``,
    separated by any of space, tab, ``,``, ``;``, ``:`` or ``!`` (the C's
    delimiters).  ``(X, Y, Z)`` is the position of the source relative to the
    sample, in metres (only its direction matters: the incident beam runs from
    the source to the sample).  ``lambda`` is the wavelength in **metres**.
    A lambda above 1e-6 m (10000 Å) is refused as a unit mistake.
    ``weight`` is read but nanoBragg ignores it (every source counts 1 and the
    sum is divided by the number of sources).  Blank lines are skipped; unlike
    the C, ``#`` starts a comment (the C would read such a line as zeros).
    Columns beyond the fifth are ignored, as in the C, with a logged warning.

Missing trailing columns (and explicit ``nan`` values) take nanoBragg's
defaults.  Those that depend on other settings are returned as NaN:

* X, Y, Z: NaN -> ``-source_distance * beam_vector`` (source_distance 10 m);
* weight: 1.0 (filled in here);
* lambda: NaN -> the ``-lambda`` wavelength.

:func:`fill_source_defaults` applies them.  Unlike the C, a last line without
a newline is read correctly (the C reads its missing columns as 0).
"""

from __future__ import annotations

import logging
import math
import os
import re

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.raw import read_text_lines

__all__ = ["read_sourcefile", "fill_source_defaults", "DEFAULT_SOURCE_DISTANCE_M"]

log = logging.getLogger(__name__)

#: nanoBragg's default sample-to-source distance (m) for missing X, Y, Z.
DEFAULT_SOURCE_DISTANCE_M = 10.0
#: Longest source wavelength accepted (m): anything longer is a unit mistake (Å written as metres).
MAX_SOURCE_LAMBDA_M = 1e-6
_DELIMITERS = re.compile(r"[ \t,;:!\r]+")
_COLUMNS = ("X", "Y", "Z", "weight", "lambda")


def read_sourcefile(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a source list; return float64 ``(n, 5)`` columns X, Y, Z (m), weight, lambda (m).

    NaN marks "use nanoBragg's default" (see module docstring).
    """
    name = str(path)
    rows: list[list[float]] = []
    for lineno, text in enumerate(read_text_lines(path, "source file"), start=1):
        body = text.split("#", 1)[0]
        tokens = [tok for tok in _DELIMITERS.split(body) if tok]
        if not tokens:
            continue
        if len(tokens) > 5:
            log.warning("%s line %d: %d columns, only the first 5 (X Y Z weight lambda) are used",
                        name, lineno, len(tokens))
            tokens = tokens[:5]
        row = [math.nan] * 5
        for col, token in enumerate(tokens):
            try:
                value = float(token)
            except ValueError:
                raise InputError(f"{name} line {lineno}: {_COLUMNS[col]} is not a number: {token!r}") from None
            if math.isinf(value):
                raise InputError(f"{name} line {lineno}: {_COLUMNS[col]} is not finite: {token!r}")
            row[col] = value
        if math.isnan(row[3]):
            row[3] = 1.0
        if not math.isnan(row[4]) and row[4] <= 0.0:
            raise InputError(f"{name} line {lineno}: lambda must be positive (metres), got {row[4]:g}")
        if not math.isnan(row[4]) and row[4] > MAX_SOURCE_LAMBDA_M:
            raise InputError(f"{name} line {lineno}: lambda {row[4]:g} m is not an X-ray wavelength: the column is "
                             f"in metres (1 A = 1e-10 m), at most {MAX_SOURCE_LAMBDA_M:g}")
        rows.append(row)
    if not rows:
        raise InputError(f"{name}: no sources found (expected lines 'X Y Z weight lambda')")
    return np.array(rows, dtype=np.float64)


def fill_source_defaults(
    sources: np.ndarray,
    *,
    beam_vector: np.ndarray,
    wavelength_m: float,
    source_distance_m: float = DEFAULT_SOURCE_DISTANCE_M,
) -> np.ndarray:
    """Return a copy of ``sources`` (n, 5) with NaNs replaced by nanoBragg's defaults.

    ``beam_vector`` is the unit incident-beam direction of the convention in
    use; a missing X/Y/Z component becomes that component of
    ``-source_distance_m * beam_vector``; a missing lambda becomes ``wavelength_m``.
    """
    out = np.array(sources, dtype=np.float64, copy=True)
    if out.ndim != 2 or out.shape[1] != 5:
        raise InputError(f"source table must have shape (n, 5), got {out.shape}")
    beam = np.asarray(beam_vector, dtype=np.float64).reshape(3)
    default_xyz = -float(source_distance_m) * beam
    for col in range(3):
        missing = np.isnan(out[:, col])
        out[missing, col] = default_xyz[col]
    out[np.isnan(out[:, 3]), 3] = 1.0
    out[np.isnan(out[:, 4]), 4] = float(wavelength_m)
    return out
