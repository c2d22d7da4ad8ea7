"""Per-image rows of named numbers held as one array (:class:`ValueRows`), gathered from the processes that hold
the images (:func:`gather_value_rows`).

A joint run's result lists every image's values, esds and fit in every process.  As Python dicts these take a few
kilobytes an image; :class:`ValueRows` keeps them as one ``(n, m)`` float64 array with a presence mask (9 bytes a
number) and hands out each row as a dict when read, so that a process holds a few numbers per image of the whole
set (a column that is the same in every row once), and its own images' dicts only while it computes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["ValueRows", "gather_value_rows"]


class ValueRows(Sequence):
    """A read-only sequence of dicts ``{name: number}`` given as ``values`` (n, m) and ``present`` (n, m) (a name
    absent from a row is not in its dict); the names in ``ints`` read back as ``int``.  A column with the same bits
    in every row (a shared or fixed name) is kept once (:attr:`constants`), the others as :attr:`values`."""

    def __init__(self, names: Sequence[str], values: np.ndarray, present: np.ndarray, ints=(),
                 constants: Mapping[str, float] | None = None) -> None:
        self.names = tuple(names)
        constants = dict(constants or {})
        columns = [k for k in self.names if k not in constants]
        values = np.asarray(values, dtype=np.float64)
        present = np.asarray(present, dtype=bool)
        if values.ndim != 2 or values.shape[1] != len(columns) or present.shape != values.shape:
            raise ValueError(f"values {values.shape}, present {present.shape}: expected (n, {len(columns)}) each")
        self.ints = frozenset(ints)
        self.n = values.shape[0]
        bits = values.view(np.int64)
        same = present.all(0) & (bits == bits[:1]).all(0) if self.n else np.zeros(len(columns), bool)
        #: name -> its value in every row (the columns with the same bits in all)
        self.constants = {**constants, **{k: float(values[0, j]) for j, k in enumerate(columns) if same[j]}}
        self.varying = tuple(k for j, k in enumerate(columns) if not same[j])
        self.values = np.ascontiguousarray(values[:, ~same])
        self.present = np.ascontiguousarray(present[:, ~same])
        self._column = {k: j for j, k in enumerate(self.varying)}

    @classmethod
    def from_dicts(cls, rows: Sequence[Mapping[str, Any]]) -> "ValueRows":
        """The rows of dicts of numbers (None: absent)."""
        names = list(dict.fromkeys(k for r in rows for k in r))
        values = np.zeros((len(rows), len(names)))
        present = np.zeros((len(rows), len(names)), dtype=bool)
        for i, r in enumerate(rows):
            for j, k in enumerate(names):
                if r.get(k) is not None:
                    values[i, j], present[i, j] = float(r[k]), True
        ints = {k for k in names if any(isinstance(r.get(k), int) and not isinstance(r.get(k), bool) for r in rows)}
        return cls(names, values, present, ints)

    def __len__(self) -> int:
        return self.n

    def _row(self, i: int) -> dict:
        values, present = self.values[i].tolist(), self.present[i].tolist()
        out = {}
        for k in self.names:
            j = self._column.get(k)
            if j is None:
                v = self.constants[k]
            elif present[j]:
                v = values[j]
            else:
                continue
            out[k] = int(v) if k in self.ints else v
        return out

    def column(self, name: str) -> np.ndarray:
        """(n,) the values of ``name`` (NaN where absent)."""
        if name in self.constants:
            return np.full(self.n, self.constants[name])
        j = self._column[name]
        return np.where(self.present[:, j], self.values[:, j], np.nan)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self._row(i % len(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != len(self):
            return NotImplemented if not isinstance(other, Sequence) else False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ValueRows({len(self)} rows of {', '.join(self.names)})"

    def nbytes(self) -> int:
        """Bytes of the arrays."""
        return self.values.nbytes + self.present.nbytes


def _same_bits(rows: Sequence[Mapping[str, Any]], name: str) -> float | None:
    """The value ``name`` has with the same bits in every one of ``rows`` (None: absent from one, or varying)."""
    first = rows[0].get(name)
    if first is None:
        return None
    bits = np.float64(first).view(np.int64)
    for r in rows[1:]:
        v = r.get(name)
        if v is None or np.float64(v).view(np.int64) != bits:
            return None
    return float(first)


def gather_value_rows(comm, local: Mapping[int, Mapping[str, Any]], n: int) -> ValueRows:
    """The ``n`` rows (``local``: this process's images' dicts, by index) in every process: the names are those of
    every process's rows, ordered by the first image that has each (the same order for any number of processes);
    a name with the same value in every row of every process is sent once, the others' numbers in one exact gather
    (:meth:`refine.many.distributed.Comm.gather`) of the varying names only."""
    firsts: dict[tuple, int] = {}
    for i in sorted(local):
        keys = tuple((k, isinstance(v, int) and not isinstance(v, bool)) for k, v in local[i].items())
        firsts.setdefault(keys, i)
    rows = [local[i] for i in sorted(local)]
    same = {k: v for k in dict.fromkeys(k for r in rows for k in r) if (v := _same_bits(rows, k)) is not None}
    parts = comm.gather_objects({comm.rank: (sorted((i, keys) for keys, i in firsts.items()), same)}, comm.world)
    names: dict[str, bool] = {}
    for _, keys in sorted(p for part in parts if part for p in part[0]):
        for k, is_int in keys:
            names[k] = names.get(k, False) or is_int
    holders = [part[1] for part in parts if part and part[0]]  # the processes that hold images
    constants = {k: holders[0][k] for k in names if holders and all(
        k in h and np.float64(h[k]).view(np.int64) == np.float64(holders[0][k]).view(np.int64) for h in holders)}
    order = [k for k in names if k not in constants]
    width = len(order)
    packed = {}
    for i, row in local.items():
        v = torch.zeros(2 * width, dtype=torch.float64)
        for j, k in enumerate(order):
            if row.get(k) is not None:
                v[j], v[width + j] = float(row[k]), 1.0
        packed[i] = v
    got = comm.gather(packed, n, (2 * width,), torch.float64).numpy()
    return ValueRows(list(names), got[:, :width], got[:, width:] > 0.5, {k for k, on in names.items() if on}, constants)
