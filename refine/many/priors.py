"""Gaussian priors on the shared names of a joint refinement (:func:`refine.many.joint.refine_joint`'s ``priors``).

A prior ``name -> (mean, sigma)`` (the name's own unit) is a measurement of that shared name with that esd: DIALS's
refined distance and beam centre with the esds its spots give them (:mod:`refine.inputs.geometry_prior`), or a
user's ``--prior``.  It enters the joint run once, not once per image:

* the loss: ``0.5 ((value - mean) / sigma)^2`` (the half deviance's scale: 0.5 is one standard deviation), added
  to the sum over images with its gradient (:attr:`~refine.many.joint_images.Joint.extra`);
* the curvature ``1 / sigma^2`` on its diagonal (:attr:`~refine.many.joint_images.Joint.curvature`), in the
  preconditioner (raw units, ``D^2 / sigma^2`` with ``D = d physical / d raw``) and in both covariances (physical
  units), in the Fisher matrix and the sandwich's meat: a measurement's score varies as its information, so the
  cell's esds carry the geometry's uncertainty.

A joint run's amplitude restraint uses the same two hooks; the prior is added to it.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.fitting.objective import check_priors
from refine.fitting.parameters import ParameterMap
from refine.solver.precondition import physical_per_raw

__all__ = ["shared_priors", "add_priors", "prior_terms"]


def shared_priors(priors: Mapping[str, tuple[float, float]] | None, shared_names: Sequence[str],
                  what: str = "priors") -> dict[str, tuple[float, float]]:
    """``priors`` checked (:func:`refine.fitting.objective.check_priors`), each on a shared name: a per-image name's
    prior would be one per image, and a held name's would restrain nothing; errors name ``what``."""
    out = check_priors(priors, what)
    other = [k for k in out if k not in shared_names]
    if other:
        raise InputError(f"{what}: {', '.join(other)} not among the shared names ({', '.join(shared_names)}); a joint "
                         "run's priors restrain shared names (--shared)")
    return out


def prior_terms(priors: Mapping[str, tuple[float, float]], shared_map: ParameterMap
                ) -> tuple[Callable[[Tensor], tuple[Tensor, Tensor]], Callable[[Tensor, bool], Tensor]]:
    """``(term, curvature)``: ``raw_shared -> (loss term, its gradient)`` and ``(raw_shared, raw_units) -> (S, S)``."""
    names = list(shared_map.names)
    index = torch.tensor([names.index(k) for k in priors], dtype=torch.long)
    mean = torch.tensor([m for m, _ in priors.values()], dtype=torch.float64)
    sigma = torch.tensor([s for _, s in priors.values()], dtype=torch.float64)

    def term(raw_shared: Tensor) -> tuple[Tensor, Tensor]:
        r = raw_shared.detach().to(torch.float64).clone().requires_grad_(True)
        with torch.enable_grad():
            physical = torch.stack(list(shared_map.physical(r).values()))
            value = 0.5 * (((physical[index] - mean) / sigma) ** 2).sum()
            (grad,) = torch.autograd.grad(value, r)
        return value.detach(), grad.to(raw_shared.dtype)

    def curvature(raw_shared: Tensor, raw_units: bool) -> Tensor:
        R = torch.zeros(len(names), len(names), dtype=torch.float64)
        R[index, index] = 1.0 / sigma ** 2
        if raw_units:
            d = physical_per_raw(shared_map, raw_shared.detach().to(torch.float64))
            R = d[:, None] * R * d[None, :]
        return R

    return term, curvature


def add_priors(joint, priors: Mapping[str, tuple[float, float]], shared_map: ParameterMap) -> None:
    """``joint``'s once-per-run loss term and curvature with the priors added (to the amplitude restraint's, when it
    has one); nothing without priors."""
    if not priors:
        return
    term, curvature = prior_terms(priors, shared_map)
    extra, curv = joint.extra, joint.curvature

    def both_terms(raw_shared: Tensor) -> tuple[Tensor, Tensor]:
        value, grad = term(raw_shared)
        if extra is not None:
            v2, g2 = extra(raw_shared)
            value, grad = value + v2.to(value.dtype), grad + g2.to(grad.dtype)
        return value, grad

    def both_curvatures(raw_shared: Tensor, raw_units: bool) -> Tensor:
        R = curvature(raw_shared, raw_units)
        return R if curv is None else R + curv(raw_shared, raw_units).to(R.dtype)

    joint.extra, joint.curvature = both_terms, both_curvatures
