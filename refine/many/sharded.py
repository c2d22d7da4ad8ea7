"""A joint run's raw vector split over its processes: :class:`ShardedVector`, :func:`sharded_type`.

The raw vector of a joint run is ``[shared (S), image 0's own (K), image 1's own (K), ...]``.  Each process
holds only ``[shared, its own images' parts]`` (its images in increasing order): the shared part is the same
in every process, every image's part lives on the one process that holds the image.  The step rule (L-BFGS
with its line search, Adam) and the loop work on that local vector unchanged, because the vector's type
makes the reductions they use global:

* ``dot``, and ``sum`` without a dimension: the exact sum over every process's terms (:mod:`refine.many.exact_sum`;
  the shared part counted once, by process 0): the same bits for any number of processes;
* ``max``/``min``/``amax``/``amin`` without a dimension: over every process (exact);
* ``all``/``any`` without a dimension: over every process.

Every other operation is elementwise or local and keeps the type (and so the layout).  A full reduction this
module does not know (``mean``, ``norm``, ``prod``, ...) raises, so no step rule can take a process-local
value for a global one.  Each process calls the same reductions in the same order (its control flow depends
only on global values), so the collectives match.  With one process nothing is sent and the sums are still
exact, so one and several processes give the same bits.

What the step rule keeps per still is then the still's own ``K`` numbers per vector, on its own process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from refine.many.exact_sum import exact_sums

__all__ = ["ShardedLayout", "ShardedVector", "sharded_type", "is_sharded"]


@dataclass(frozen=True)
class ShardedLayout:
    """Where a process's local vector sits in the whole: ``shared`` leading numbers (the same in every process),
    counted in sums by process 0 only; ``reduce_sum``/``reduce_max``/``reduce_min``: in-place all_reduce over the
    processes (None: one process)."""

    shared: int
    counts_shared: bool
    reduce_sum: Callable[[Tensor], None] | None = None
    reduce_max: Callable[[Tensor], None] | None = None
    reduce_min: Callable[[Tensor], None] | None = None

    def terms(self, local: Tensor) -> Tensor:
        """The terms of a global sum this process adds: its own part, and the shared one on process 0."""
        return local if self.counts_shared else local[self.shared:]

    def agree(self, flag: bool) -> bool:
        """True only when ``flag`` is True in every process."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        if self.reduce_min is not None:
            self.reduce_min(value)
        return bool(value.item())


def _plain(t: Any) -> Any:
    return t.as_subclass(Tensor) if isinstance(t, ShardedVector) else t


def _full(args: tuple, kwargs: dict) -> bool:
    """A reduction over every element (no dimension given)."""
    return len(args) <= 1 and not {"dim", "axis"} & set(kwargs)


class ShardedVector(Tensor):
    """A process's part of a vector split over processes (module docstring); made by :func:`sharded_type`."""

    layout: ClassVar[ShardedLayout]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _REDUCTIONS and (name == "dot" or _full(args, kwargs)) and hasattr(cls, "layout"):
            if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
                raise NotImplementedError(f"{name}() of a vector split over processes is not differentiable "
                                          "(refine.many.sharded)")
            with torch._C.DisableTorchFunctionSubclass():
                return _REDUCTIONS[name](cls.layout, *[_plain(a) for a in args])
        if name in _REFUSED and _full(args, kwargs):
            raise NotImplementedError(f"{name}() of a vector split over processes: not a global value here "
                                      "(refine.many.sharded)")
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def agree(cls, flag: bool) -> bool:
        """True only when ``flag`` is True in every process."""
        return cls.layout.agree(flag)


def _dot(layout: ShardedLayout, a: Tensor, b: Tensor) -> Tensor:
    return exact_sums(layout.terms(a * b), layout.reduce_sum).to(a.dtype)


def _sum(layout: ShardedLayout, a: Tensor) -> Tensor:
    if not a.is_floating_point():
        value = layout.terms(a).sum().reshape(1).to(torch.int64)
        if layout.reduce_sum is not None:
            layout.reduce_sum(value)
        return value[0]
    return exact_sums(layout.terms(a).reshape(-1), layout.reduce_sum).to(a.dtype)


def _extreme(largest: bool) -> Callable[[ShardedLayout, Tensor], Tensor]:
    def reduce(layout: ShardedLayout, a: Tensor) -> Tensor:
        local = (a.max() if largest else a.min()).reshape(1).to(torch.float64)
        nan = torch.isnan(local)  # a NaN anywhere is the answer everywhere
        sign = 1.0 if largest else -1.0  # the smallest is minus the largest of the negatives: one collective
        both = torch.cat([torch.where(nan, torch.zeros_like(local), sign * local), nan.to(torch.float64)])
        if layout.reduce_max is not None:
            layout.reduce_max(both)
        return (torch.tensor(float("nan")) if both[1] > 0 else sign * both[0]).to(a.dtype)
    return reduce


def _logical(every: bool) -> Callable[[ShardedLayout, Tensor], Tensor]:
    def reduce(layout: ShardedLayout, a: Tensor) -> Tensor:
        value = (a.all() if every else a.any()).reshape(1).to(torch.int64)
        op = layout.reduce_min if every else layout.reduce_max
        if op is not None:
            op(value)
        return value[0].to(torch.bool)
    return reduce


_REDUCTIONS = {"dot": _dot, "sum": _sum, "max": _extreme(True), "amax": _extreme(True), "min": _extreme(False),
               "amin": _extreme(False), "all": _logical(True), "any": _logical(False)}
_REFUSED = {"mean", "norm", "prod", "nansum", "std", "var", "vdot", "inner", "argmax", "argmin", "median",
            "vector_norm", "linalg_vector_norm", "count_nonzero"}


def sharded_type(layout: ShardedLayout) -> type[ShardedVector]:
    """A :class:`ShardedVector` type for one run's layout: ``local.as_subclass(T)`` makes a process's part."""
    return type("ShardedVector", (ShardedVector,), {"layout": layout})


def is_sharded(t: Any) -> bool:
    return isinstance(t, ShardedVector)
