"""Sums of float64 numbers that do not depend on their order or on how they are split over processes.

A joint run's loss, its shared gradient and every dot product of its step rule are sums over the stills of
the whole set, and the stills are split over the processes of a torchrun.  A floating-point sum depends on
the order of its terms, so a plain ``all_reduce`` of per-process partial sums would give other bits for
another number of processes.  :func:`exact_sums` instead adds the terms *exactly*, as integers: every
float64 ``m 2^e`` (``m`` a 53-bit integer) is an integer multiple of ``2^-1126`` (the last bit of the smallest
subnormal, with room for ``frexp``'s normalised mantissa), written into 70 limbs of 32 bits each held in int64
(:data:`LIMBS`); limbs of many terms add up in int64 without overflow (a term adds less than ``2^33`` to a
limb: 2^30 terms a process at the least), the processes' limbs are added by one integer ``all_reduce``
(exact, in any order), and the total is rounded once to the nearest float64 (Python's correctly rounded
integer division).  So the sum is the correctly rounded exact sum of the terms, the same bits for any order,
any split and any number of processes, and at least as accurate as any ordered float sum.

NaN and infinities follow IEEE addition: a NaN term, or infinities of both signs, give NaN; infinities of one
sign give that infinity.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

__all__ = ["exact_sums", "ExactSum", "LIMBS", "LIMB_BITS"]

#: bits of a limb; limbs of the accumulator; the weight of limb 0's lowest bit is ``2^-OFFSET``
LIMB_BITS = 32
LIMBS = 70
OFFSET = 1126
_MASK = (1 << LIMB_BITS) - 1


def _limbs(terms: Tensor) -> Tensor:
    """(C, LIMBS + 3) int64: for each column of ``terms`` (T, C) float64, its finite terms' exact sum as limbs,
    then the counts of NaN, +inf and -inf terms."""
    T, C = terms.shape
    finite = torch.isfinite(terms)
    counts = torch.stack([torch.isnan(terms).sum(0), (terms == math.inf).sum(0), (terms == -math.inf).sum(0)], 1)
    x = torch.where(finite, terms, torch.zeros_like(terms))
    mant, expo = torch.frexp(x)
    m = torch.ldexp(mant, torch.tensor(53, dtype=torch.int32)).to(torch.int64)  # exact: |m| < 2^53
    sign, a = torch.sign(m), m.abs()
    offset = expo.to(torch.int64) - 53 + OFFSET  # >= 0 for every float64; 0 terms give m = 0
    limb, shift = torch.div(offset, LIMB_BITS, rounding_mode="floor"), offset % LIMB_BITS
    lo = (a & _MASK) << shift  # < 2^63
    hi = (a >> LIMB_BITS) << shift  # < 2^52
    parts = (lo & _MASK, (lo >> LIMB_BITS) + (hi & _MASK), hi >> LIMB_BITS)
    acc = torch.zeros(C * LIMBS, dtype=torch.int64)
    column = torch.arange(C, dtype=torch.int64).expand(T, C) * LIMBS
    for k, part in enumerate(parts):
        acc.index_add_(0, (column + limb + k).reshape(-1), (sign * part).reshape(-1))
    return torch.cat([acc.reshape(C, LIMBS), counts.to(torch.int64)], 1)


def _rounded(row: list[int]) -> float:
    """One column's limbs and special counts -> the correctly rounded float64 sum."""
    nan, pos, neg = row[LIMBS:]
    if nan or (pos and neg):
        return math.nan
    if pos or neg:
        return math.inf if pos else -math.inf
    nonzero = [k for k in range(LIMBS) if row[k]]
    if not nonzero:
        return 0.0
    low, total = nonzero[0], 0
    for k in range(nonzero[-1], low - 1, -1):  # sum of row[k] 2^(32 (k - low)), exactly (signed limbs)
        total = (total << LIMB_BITS) + row[k]
    try:
        return total / (1 << (OFFSET - LIMB_BITS * low)) if OFFSET >= LIMB_BITS * low else float(total << (LIMB_BITS * low - OFFSET))
    except OverflowError:
        return math.inf if total > 0 else -math.inf


class ExactSum:
    """The exact column sums of terms given a chunk at a time (:meth:`add`; the memory of one chunk, not of all
    the terms), rounded once by :meth:`total`: the same bits as :func:`exact_sums` of all the chunks stacked."""

    def __init__(self, columns: int) -> None:
        self.columns = int(columns)
        self.acc = torch.zeros(self.columns, LIMBS + 3, dtype=torch.int64)

    def add(self, terms: Tensor) -> None:
        """Add the rows of ``terms`` (T, C) float64 (or (C,): one row)."""
        terms = terms.detach().to(device="cpu", dtype=torch.float64).reshape(-1, self.columns)
        if terms.shape[0]:
            self.acc += _limbs(terms)

    def total(self, reduce: Callable[[Tensor], None] | None = None) -> Tensor:
        """(C,) float64: the correctly rounded sums, over every process's terms with ``reduce``."""
        acc = self.acc.clone()
        if reduce is not None:
            reduce(acc)
        return torch.tensor([_rounded(row) for row in acc.tolist()], dtype=torch.float64)


def exact_sums(terms: Tensor, reduce: Callable[[Tensor], None] | None = None) -> Tensor:
    """(C,) float64: each column's correctly rounded exact sum of ``terms`` (T, C) (or (T,): one column),
    over this process's terms and, with ``reduce`` (an in-place integer ``all_reduce`` sum of the other
    processes'), over every process's: the same bits for any order and split of the terms.
    """
    if terms.dim() == 1:
        return exact_sums(terms.reshape(-1, 1), reduce).reshape(())
    total = ExactSum(terms.shape[1])
    total.add(terms)
    return total.total(reduce)
