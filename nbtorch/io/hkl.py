"""Structure-factor files: nanoBragg's text ``-hkl`` format and its ``Fdump.bin`` cache.

Text HKL format (read by :func:`read_hkl`, written by :func:`write_hkl`)
    One reflection per line: ``h k l F``, whitespace-separated.  ``F`` is the
    structure-factor *amplitude* (electrons, not intensity).  Indices may be
    negative and must be integers (``3`` or ``3.0``; ``1.5`` is an error).
    ``F`` must be finite.  Blank lines are ignored and ``#`` starts a comment
    that runs to the end of the line.  nanoBragg itself reads the numbers with
    ``fscanf("%lg%lg%lg%lg")`` and stops silently at the first thing it cannot
    parse; this reader instead rejects any line that is not exactly four
    numbers.  A reflection listed twice keeps its last value, as in nanoBragg.

Dense grid (:meth:`HKLTable.to_grid`)
    nanoBragg stores F on a dense float64 grid indexed ``[h - h_min, k - k_min,
    l - l_min]`` whose bounds are the min/max indices in the file, prefilled with
    ``default_F``, so reflections missing from the file but inside the bounds get
    ``default_F``.

``Fdump.bin`` (read by :func:`read_fdump`, written by :func:`write_fdump`)
    The ASCII text ``"h_min h_max k_min k_max l_min l_max\\n\\f"`` (``%d``
    separated by single spaces), immediately followed by
    ``(h_range+1) * (k_range+1) * (l_range+1)`` float64 values, h-major then k
    then l (l fastest), where ``x_range = x_max - x_min + 1``.  The C writes one
    extra (zero) slab at the high end of every axis, which is padding:
    :func:`read_fdump` drops it and :func:`write_fdump` writes zeros there, so
    files are byte-identical to nanoBragg's.  Doubles are little-endian (the C
    writes native order; every supported platform is little-endian).  Note: the
    C reads the header with ``fscanf("%d...%d\\n\\f")``, which also swallows any
    whitespace-valued bytes (0x09-0x0d, 0x20) at the start of the binary data; this
    reader uses the exact layout instead.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from nbtorch.errors import InputError
from nbtorch.io.atomic import atomic_write
from nbtorch.io.raw import read_file_bytes, read_text_lines

__all__ = ["HKLTable", "grid_description", "read_hkl", "write_hkl", "read_fdump", "write_fdump", "fdump_bytes"]

#: Largest dense grid (elements) that :meth:`HKLTable.to_grid` will allocate (8 GB of float64).
MAX_GRID_ELEMENTS = 1_000_000_000
_MAX_INDEX = 2**31 - 1


def grid_description(lo, hi) -> str:
    """``index ranges h a..b, k c..d, l e..f need a grid of N cells (X GB as float64)`` for the
    inclusive Miller-index ranges ``lo`` .. ``hi`` (h, k, l) of a dense structure-factor grid."""
    (h0, k0, l0), (h1, k1, l1) = (int(v) for v in lo), (int(v) for v in hi)
    cells = (h1 - h0 + 1) * (k1 - k0 + 1) * (l1 - l0 + 1)
    return (f"index ranges h {h0}..{h1}, k {k0}..{k1}, l {l0}..{l1} need a grid of {cells} cells "
            f"({cells * 8 / 1e9:.3g} GB as float64)")


@dataclass(frozen=True, eq=False)
class HKLTable:
    """Reflections as parallel read-only arrays: ``h, k, l`` (int64) and ``F`` (float64).

    ``source`` names the file the table came from (used in error messages).
    """

    h: np.ndarray
    k: np.ndarray
    l: np.ndarray  # noqa: E741 - crystallographic name
    F: np.ndarray
    source: str = field(default="<memory>")

    def __post_init__(self) -> None:
        arrays = {}
        for name, dtype in (("h", np.int64), ("k", np.int64), ("l", np.int64), ("F", np.float64)):
            arr = np.array(getattr(self, name), dtype=dtype).reshape(-1)
            arr.setflags(write=False)
            arrays[name] = arr
        n = {arr.size for arr in arrays.values()}
        if len(n) != 1:
            raise InputError(f"{self.source}: h, k, l and F must have the same length")
        for name, arr in arrays.items():
            object.__setattr__(self, name, arr)

    def __len__(self) -> int:
        return int(self.F.size)

    @property
    def bounds(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """``((h_min, h_max), (k_min, k_max), (l_min, l_max))``, inclusive."""
        if len(self) == 0:
            raise InputError(f"{self.source}: no reflections")
        return tuple((int(a.min()), int(a.max())) for a in (self.h, self.k, self.l))  # type: ignore[return-value]

    def grid_description(self) -> str:
        """:func:`grid_description` of this table's index ranges."""
        (h0, h1), (k0, k1), (l0, l1) = self.bounds
        return grid_description((h0, k0, l0), (h1, k1, l1))

    def to_grid(self, default_F: float = 0.0) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Return the dense float64 grid ``(nh, nk, nl)`` and ``(h_min, k_min, l_min)``.

        Grid cells without a reflection hold ``default_F``; a reflection given
        twice keeps its last value.  A grid over :data:`MAX_GRID_ELEMENTS` cells,
        or one that does not fit in memory, is an :class:`InputError` naming the
        index ranges (a stray reflection far from the others is the usual cause).
        """
        (h0, h1), (k0, k1), (l0, l1) = self.bounds
        shape = (h1 - h0 + 1, k1 - k0 + 1, l1 - l0 + 1)
        if math.prod(shape) > MAX_GRID_ELEMENTS:
            raise InputError(f"{self.source}: {self.grid_description()}, over the limit of {MAX_GRID_ELEMENTS} cells")
        try:
            grid = np.full(shape, float(default_F), dtype=np.float64)
            flat = np.ravel_multi_index((self.h - h0, self.k - k0, self.l - l0), shape)
            # keep the last occurrence of each index: unique on the reversed order
            rev_unique, rev_first = np.unique(flat[::-1], return_index=True)
            grid.reshape(-1)[rev_unique] = self.F[::-1][rev_first]
        except MemoryError:
            raise InputError(f"{self.source}: not enough memory: {self.grid_description()}") from None
        return grid, (h0, k0, l0)


def _parse_hkl_line(path: str, lineno: int, text: str) -> tuple[int, int, int, float] | None:
    body = text.split("#", 1)[0]
    fields = body.split()
    if not fields:
        return None
    if len(fields) != 4:
        raise InputError(f"{path} line {lineno}: expected 4 fields 'h k l F', got {len(fields)}: {body.strip()!r}")
    try:
        values = [float(tok) for tok in fields]
    except ValueError:
        bad = next(tok for tok in fields if not _is_float(tok))
        raise InputError(f"{path} line {lineno}: not a number: {bad!r}") from None
    indices = []
    for name, value in zip("hkl", values[:3]):
        if not math.isfinite(value) or value != round(value) or abs(value) > _MAX_INDEX:
            raise InputError(f"{path} line {lineno}: Miller index {name} must be an integer (|index| < 2^31), got {value:g}")
        indices.append(int(value))
    F = values[3]
    if not math.isfinite(F):
        raise InputError(f"{path} line {lineno}: F must be finite, got {F}")
    return indices[0], indices[1], indices[2], F


def _is_float(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def read_hkl(path: str | os.PathLike[str]) -> HKLTable:
    """Read a text ``h k l F`` file (see module docstring) into an :class:`HKLTable`."""
    name = str(path)
    lines = read_text_lines(path, "hkl file")
    h: list[int] = []
    k: list[int] = []
    l: list[int] = []  # noqa: E741
    F: list[float] = []
    for lineno, text in enumerate(lines, start=1):
        row = _parse_hkl_line(name, lineno, text)
        if row is None:
            continue
        h.append(row[0])
        k.append(row[1])
        l.append(row[2])
        F.append(row[3])
    if not F:
        raise InputError(f"{name}: no reflections found (expected lines 'h k l F')")
    return HKLTable(h=h, k=k, l=l, F=F, source=name)


def write_hkl(path: str | os.PathLike[str], table: HKLTable) -> None:
    """Write ``table`` as text ``h k l F`` lines; F keeps full double precision. Atomic."""
    if len(table) == 0:
        raise InputError(f"{path}: refusing to write an hkl file with no reflections")
    if not np.all(np.isfinite(table.F)):
        raise InputError(f"{path}: cannot write non-finite F values")
    lines = [
        f"{h:4d} {k:4d} {l:4d} {F!r}\n"
        for h, k, l, F in zip(table.h.tolist(), table.k.tolist(), table.l.tolist(), table.F.tolist())
    ]
    with atomic_write(path, "w", encoding="ascii") as handle:
        handle.writelines(lines)


_FDUMP_HEADER = re.compile(rb"\A\s*(-?\d+)\s+(-?\d+)\s+(-?\d+)\s+(-?\d+)\s+(-?\d+)\s+(-?\d+)\n\f")


def read_fdump(path: str | os.PathLike[str]) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Read a nanoBragg ``Fdump.bin``; return the float64 grid ``(nh, nk, nl)`` and ``(h_min, k_min, l_min)``."""
    data = read_file_bytes(path, "Fdump file")
    match = _FDUMP_HEADER.match(data[:200])
    if match is None:
        raise InputError(f"{path}: not an Fdump file (expected six integers and '\\n\\f' at the start)")
    h_min, h_max, k_min, k_max, l_min, l_max = (int(v) for v in match.groups())
    shape = (h_max - h_min + 1, k_max - k_min + 1, l_max - l_min + 1)
    if min(shape) < 1:
        raise InputError(f"{path}: invalid index ranges h {h_min}..{h_max}, k {k_min}..{k_max}, l {l_min}..{l_max}")
    padded = (shape[0] + 1, shape[1] + 1, shape[2] + 1)
    if math.prod(padded) > MAX_GRID_ELEMENTS:
        raise InputError(f"{path}: index ranges too large ({math.prod(padded)} cells)")
    expected = math.prod(padded) * 8
    payload = len(data) - match.end()
    if payload != expected:
        raise InputError(
            f"{path}: expected {expected} bytes of float64 data for ranges "
            f"h {h_min}..{h_max}, k {k_min}..{k_max}, l {l_min}..{l_max}, found {payload}"
        )
    full = np.frombuffer(data, dtype="<f8", offset=match.end()).reshape(padded)
    grid = full[: shape[0], : shape[1], : shape[2]].astype(np.float64)
    return grid, (h_min, k_min, l_min)


def write_fdump(path: str | os.PathLike[str], grid: np.ndarray, mins: tuple[int, int, int]) -> None:
    """Write a dense F grid ``(nh, nk, nl)`` with lowest indices ``mins`` as nanoBragg's ``Fdump.bin``. Atomic."""
    data = fdump_bytes(path, grid, mins)
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def fdump_bytes(path: str | os.PathLike[str], grid: np.ndarray, mins: tuple[int, int, int]) -> bytes:
    """The bytes :func:`write_fdump` writes (``path`` only names the file in errors)."""
    arr = np.asarray(grid, dtype=np.float64)
    if arr.ndim != 3 or min(arr.shape) < 1:
        raise InputError(f"{path}: F grid must be a non-empty 3-D array, got shape {arr.shape}")
    if len(mins) != 3:
        raise InputError(f"{path}: mins must be (h_min, k_min, l_min)")
    h_min, k_min, l_min = (int(v) for v in mins)
    nh, nk, nl = arr.shape
    padded = np.zeros((nh + 1, nk + 1, nl + 1), dtype="<f8")
    padded[:nh, :nk, :nl] = arr
    header = f"{h_min} {h_min + nh - 1} {k_min} {k_min + nk - 1} {l_min} {l_min + nl - 1}\n\f"
    return header.encode("ascii") + padded.tobytes()
