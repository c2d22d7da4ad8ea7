"""MOSFLM orientation-matrix files (nanoBragg ``-mat``).

Format
    The first nine numbers of the file, read in order regardless of line
    breaks (nanoBragg uses three ``fscanf("%lg%lg%lg")`` calls), form the
    3x3 matrix ``M`` whose *columns* are a*, b*, c*, each multiplied by the
    wavelength: line ``i`` holds component ``i`` (x, y, z) of
    (a*·λ, b*·λ, c*·λ).  Everything after the ninth number (MOSFLM's U matrix,
    cell, missetting angles) is ignored.

Returned value
    :func:`read_mosflm_matrix` returns ``M.T``: the reciprocal vectors as
    **rows**, ``A[0] = a*·λ``, ``A[1] = b*·λ``, ``A[2] = c*·λ``.  Units: a* is
    in Å⁻¹ and λ in Å, so the numbers are dimensionless; divide by the
    wavelength (Å) to get Å⁻¹, as nanoBragg does with its ``-lambda`` value.
    Components are in the lab frame of the convention the file was made for
    (MOSFLM for ordinary ``-mat`` files).
"""

from __future__ import annotations

import math
import os

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from nbtorch.io.raw import read_text_lines

__all__ = ["read_mosflm_matrix", "write_mosflm_matrix"]

#: |det(A)| / (|a*| |b*| |c*|) below this is treated as singular (vectors nearly coplanar).
SINGULAR_TOLERANCE = 1e-6


def _check_matrix(path: str, A: np.ndarray) -> None:
    if not np.all(np.isfinite(A)):
        raise InputError(f"{path}: matrix contains non-finite values")
    norms = np.linalg.norm(A, axis=1)
    if np.any(norms == 0.0):
        raise InputError(f"{path}: singular matrix (a zero reciprocal vector)")
    ratio = abs(float(np.linalg.det(A))) / float(np.prod(norms))
    if ratio < SINGULAR_TOLERANCE:
        raise InputError(f"{path}: singular matrix (a*, b*, c* are coplanar: |det|/norms = {ratio:.3g})")


def read_mosflm_matrix(path: str | os.PathLike[str]) -> np.ndarray:
    """Read a MOSFLM ``-mat`` file; return float64 ``(3, 3)`` with rows a*·λ, b*·λ, c*·λ (dimensionless)."""
    name = str(path)
    numbers: list[float] = []
    for lineno, text in enumerate(read_text_lines(path, "matrix file"), start=1):
        for token in text.split():
            try:
                value = float(token)
            except ValueError:
                raise InputError(
                    f"{name} line {lineno}: not a number: {token!r} (need 9 numbers, found {len(numbers)})"
                ) from None
            if not math.isfinite(value):
                raise InputError(f"{name} line {lineno}: matrix element is not finite: {token!r}")
            numbers.append(value)
            if len(numbers) == 9:
                break
        if len(numbers) == 9:
            break
    if len(numbers) < 9:
        raise InputError(f"{name}: expected 9 numbers (3 lines of a*, b*, c* components), found {len(numbers)}")
    M = np.array(numbers, dtype=np.float64).reshape(3, 3)  # row i = component i of (a*, b*, c*)
    A = np.ascontiguousarray(M.T)
    _check_matrix(name, A)
    return A


def write_mosflm_matrix(path: str | os.PathLike[str], A: np.ndarray) -> None:
    """Write rows a*·λ, b*·λ, c*·λ as a 3-line MOSFLM ``-mat`` file (full precision). Atomic."""
    arr = np.asarray(A, dtype=np.float64)
    if arr.shape != (3, 3):
        raise InputError(f"{path}: matrix must be 3x3, got shape {arr.shape}")
    _check_matrix(str(path), arr)
    lines = [" ".join(f"{v!r:>24}" for v in row) + "\n" for row in arr.T.tolist()]
    with atomic_write(path, "w", encoding="ascii") as handle:
        handle.writelines(lines)
