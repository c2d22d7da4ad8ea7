"""Shared input checks and reductions for the image losses.

Conventions used by every loss in :mod:`losses`:

* ``model`` is a floating tensor of any shape (typically ``(slow, fast)`` or
  ``(batch, slow, fast)``); ``observed`` must have exactly the same shape and is
  cast to ``model``'s dtype and device (integer counts are fine).
* ``mask`` (optional) is a bool tensor of the same shape; ``True`` = use the
  pixel.  Masked-out pixels may hold anything in ``observed`` (NaN included):
  they are replaced by a harmless value before any arithmetic, so they give
  exactly zero loss and exactly zero gradient.
* ``weights`` (optional) is a non-negative, finite tensor broadcastable to
  ``model``'s shape.
* ``reduction``: ``'none'`` returns the per-pixel ``weights * loss`` with zeros
  on masked pixels (shape of ``model``); ``'sum'`` its sum; ``'mean'`` the
  weighted mean over unmasked pixels, ``sum(w * loss) / sum(w)``.

Every problem raises :class:`~nbtorch.errors.InputError` (a ``ValueError``)
with a one-line message that starts with the offending argument's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nbtorch.errors import InputError

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class Prepared:
    """Validated loss inputs: all of ``model``'s shape, dtype and device.

    ``model`` and ``observed`` hold ``fill`` on masked pixels (``model`` still
    carries gradients on unmasked ones); ``weights`` is ``0`` on masked pixels.
    """

    model: Tensor
    observed: Tensor
    mask: Tensor
    weights: Tensor


def check_reduction(reduction: str) -> None:
    """Raise unless ``reduction`` is one of ``'mean'``, ``'sum'``, ``'none'``."""
    if reduction not in REDUCTIONS:
        raise InputError(f"reduction: expected one of {', '.join(repr(r) for r in REDUCTIONS)}, got {reduction!r}")


def check_positive(name: str, value: float) -> None:
    """Raise unless the scalar ``value`` is finite and > 0."""
    v = float(value)
    if not (v > 0.0 and v < float("inf")):
        raise InputError(f"{name}: must be finite and > 0, got {value!r}")


def dtype_eps(dtype: torch.dtype, eps: float | None = None) -> float:
    """Floor used for logs and divisions: ``eps`` when given (must be > 0), else
    ``max(1e-12, smallest normal number of dtype)``."""
    if eps is None:
        return max(1e-12, torch.finfo(dtype).tiny)
    floor = float(eps)
    if not floor > 0:
        raise InputError(f"eps: must be > 0, got {eps!r}")
    return floor


def prepare(
    model: Tensor,
    observed: Tensor,
    mask: Tensor | None,
    weights: Tensor | float | None,
    fill: float = 1.0,
) -> Prepared:
    """Check ``model``/``observed``/``mask``/``weights`` and return them cleaned.

    Arguments:
        model: floating tensor, any shape S.
        observed: tensor of shape S (cast to ``model.dtype``).
        mask: bool tensor of shape S, or None (= all pixels used).
        weights: tensor or number broadcastable to S, >= 0, or None (= 1).
        fill: value put in ``model`` and ``observed`` on masked pixels.

    Returns: :class:`Prepared` with every field of shape S.
    """
    if not isinstance(model, Tensor) or not model.is_floating_point():
        raise InputError(f"model: expected a floating-point tensor, got {getattr(model, 'dtype', type(model).__name__)}")
    observed = torch.as_tensor(observed)
    if observed.shape != model.shape:
        raise InputError(f"observed: shape {tuple(observed.shape)} does not match model shape {tuple(model.shape)}")
    observed = observed.to(dtype=model.dtype, device=model.device)
    if mask is None:
        mask = torch.ones(model.shape, dtype=torch.bool, device=model.device)
    else:
        mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool:
            raise InputError(f"mask: expected a bool tensor (True = use pixel), got dtype {mask.dtype}")
        if mask.shape != model.shape:
            raise InputError(f"mask: shape {tuple(mask.shape)} does not match model shape {tuple(model.shape)}")
        mask = mask.to(model.device)
    if not bool(mask.any()):
        raise InputError("mask: all pixels are masked out")
    if bool((~torch.isfinite(observed) & mask).any()):
        raise InputError("observed: NaN or inf in unmasked pixels (mask them out)")
    if weights is None:
        w = mask.to(model.dtype)
    else:
        w = torch.as_tensor(weights, dtype=model.dtype, device=model.device)
        try:
            shape = torch.broadcast_shapes(w.shape, model.shape)
        except RuntimeError:
            shape = None
        if shape != model.shape:
            raise InputError(f"weights: shape {tuple(w.shape)} does not broadcast to model shape {tuple(model.shape)}")
        if not bool((torch.isfinite(w) & (w >= 0)).all()):
            raise InputError("weights: must be finite and >= 0")
        w = torch.where(mask, w, torch.zeros((), dtype=model.dtype, device=model.device))
    fill_t = torch.full((), fill, dtype=model.dtype, device=model.device)
    return Prepared(torch.where(mask, model, fill_t), torch.where(mask, observed, fill_t), mask, w)


def reduce(per_pixel: Tensor, p: Prepared, reduction: str) -> Tensor:
    """Apply weights, mask and ``reduction`` to the unweighted per-pixel loss (shape S)."""
    check_reduction(reduction)
    weighted = per_pixel * p.weights  # weights are 0 on masked pixels, where per_pixel is finite
    if reduction == "none":
        return weighted
    if reduction == "sum":
        return weighted.sum()
    total_w = p.weights.sum()
    if not bool(total_w > 0):
        raise InputError("weights: sum over unmasked pixels is zero, the weighted mean is undefined")
    return weighted.sum() / total_w
