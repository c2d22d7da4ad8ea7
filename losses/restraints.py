"""Gaussian restraints (priors) on refined parameters.

A restraint of ``value`` towards ``target`` with standard deviation ``sigma``
adds ``0.5 * sum(((value - target) / sigma)^2)``, the negative log of a
Gaussian prior up to a constant.  ``value``, ``target`` and ``sigma`` are in
the parameter's own units (e.g. Angstrom for ``cell_a``, deg for
``misset_x``); they broadcast together and the result is always summed to a
scalar.  ``sigma`` must be > 0.

:class:`Restraints` holds several named restraints and, given a dict of
parameter tensors by name (the canonical simulator names, e.g. from
``Simulator.parameters_dict``), returns their total.  Parameters in the dict
without a restraint are ignored; a restrained name missing from the dict is an
error (this is what catches misspelt names).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from losses.kernels import gaussian_restraint_terms
from nbtorch.errors import InputError

__all__ = ["gaussian_restraint", "Restraint", "Restraints"]


def _check_sigma(sigma: Tensor | float, name: str = "sigma") -> None:
    s = torch.as_tensor(sigma)
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise InputError(f"{name}: must be finite and > 0, got {sigma!r}")


def gaussian_restraint(value: Tensor, target: Tensor | float, sigma: Tensor | float) -> Tensor:
    """``0.5 * sum(((value - target) / sigma)^2)``: scalar, in the dtype of ``value``.

    Arguments:
        value: the parameter (any shape), floating tensor.
        target: restraint target, broadcastable with ``value``.
        sigma: standard deviation (> 0), broadcastable with ``value``.
    """
    _check_sigma(sigma)
    value = torch.as_tensor(value)
    if not value.is_floating_point():
        raise InputError(f"value: expected a floating-point tensor, got {value.dtype}")
    t = torch.as_tensor(target, dtype=value.dtype, device=value.device)
    s = torch.as_tensor(sigma, dtype=value.dtype, device=value.device)
    try:
        torch.broadcast_shapes(value.shape, t.shape, s.shape)
    except RuntimeError:
        raise InputError(
            f"target: shapes value {tuple(value.shape)}, target {tuple(t.shape)}, sigma {tuple(s.shape)} do not broadcast"
        ) from None
    return gaussian_restraint_terms(value, t, s).sum()


class Restraint(nn.Module):
    """Module form of :func:`gaussian_restraint` with a fixed ``target`` and ``sigma``."""

    def __init__(self, target: Tensor | float, sigma: Tensor | float) -> None:
        super().__init__()
        _check_sigma(sigma)
        self.target, self.sigma = target, sigma

    def forward(self, value: Tensor) -> Tensor:
        return gaussian_restraint(value, self.target, self.sigma)


class Restraints(nn.Module):
    """Sum of Gaussian restraints on named parameters.

    Arguments:
        restraints: mapping ``name -> (target, sigma)``.

    ``forward(params)`` takes a dict ``name -> tensor`` and returns the scalar
    total (0 for an empty set of restraints); :meth:`terms` returns the
    per-name values.
    """

    def __init__(self, restraints: Mapping[str, tuple[Tensor | float, Tensor | float]]) -> None:
        super().__init__()
        self.restraints: dict[str, Restraint] = {}
        for name, pair in restraints.items():
            if not isinstance(name, str):
                raise InputError(f"restraints: names must be strings, got {name!r}")
            try:
                target, sigma = pair
            except (TypeError, ValueError):
                raise InputError(f"restraints: {name} must map to (target, sigma), got {pair!r}") from None
            _check_sigma(sigma, f"restraints: {name} sigma")
            self.restraints[name] = Restraint(target, sigma)

    def terms(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Per-name restraint values (scalars) for the restrained names."""
        missing = sorted(set(self.restraints) - set(params))
        if missing:
            raise InputError(f"params: no value for restrained parameter(s) {', '.join(missing)}")
        return {name: r(params[name]) for name, r in self.restraints.items()}

    def forward(self, params: Mapping[str, Tensor]) -> Tensor:
        terms = self.terms(params)
        if not terms:
            dtype = next((v.dtype for v in params.values() if isinstance(v, Tensor) and v.is_floating_point()),
                         torch.get_default_dtype())
            return torch.zeros((), dtype=dtype)
        values = list(terms.values())
        total = values[0]
        for v in values[1:]:
            total = total + v  # promotes mixed dtypes
        return total

    def extra_repr(self) -> str:
        return ", ".join(f"{n}: ({r.target}, {r.sigma})" for n, r in self.restraints.items())
