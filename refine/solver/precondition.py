"""Fisher preconditioning: rescale (or whiten) the raw parameters of a stage before LBFGS sees them.

The transforms of :mod:`refine.fitting.parameters` make one raw unit a *typical*
step, but how well the image pins each parameter down differs by orders of
magnitude (a beam centre to 1e-4 pixel, a mosaic spread to 0.3 %), and LBFGS
starts from one step size and an inverse Hessian ``gamma I``.  At the start of
a stage the Gauss-Newton (Fisher) matrix ``F`` of the stage's own view in raw
units (:func:`refine.quality.uncertainty.fisher_information`) gives the curvature;
the loop then works on ``z`` with ``raw = raw0 + A z``:

* ``"diagonal"``: ``A = diag(1 / sqrt(F_ii))`` - one unit of ``z`` is one standard
  deviation of each parameter on its own;
* ``"full"``: ``A = V diag(1 / sqrt(lambda)) V^T`` from ``F = V diag(lambda) V^T``
  (eigenvalues floored at ``1e-10 lambda_max``): the Gauss-Newton Hessian becomes
  the identity.

Cost: one forward-mode pass with a tangent per free parameter (:func:`refine.quality.uncertainty.pixel_jacobian`).  ``A`` is
stored in checkpoints so a resumed stage uses the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nbtorch.errors import InputError
from refine.fitting.objective import ImageObjective
from refine.fitting.parameters import ParameterMap
from refine.fitting.structure_factors import is_amplitude
from refine.quality.uncertainty import add_restraint, fisher_information, image_information

__all__ = ["LinearPreconditioner", "make_preconditioner", "preconditioner_from_fisher", "raw_fisher_information",
           "physical_per_raw", "PRECONDITIONERS", "PRECONDITIONER_NAMES"]

PRECONDITIONERS = (None, "diagonal", "full")
#: the same as spelled on the command line and in TOML files (``"none"`` is None)
PRECONDITIONER_NAMES = tuple(k or "none" for k in PRECONDITIONERS)


@dataclass(frozen=True)
class LinearPreconditioner:
    """``raw = raw0 + A z``.

    Attributes:
        raw0: (P,) raw parameters at ``z = 0``.
        A: (P, P) matrix.
    """

    raw0: Tensor
    A: Tensor

    def to_raw(self, z: Tensor) -> Tensor:
        return self.raw0 + self.A @ z

    def z0(self) -> Tensor:
        return torch.zeros_like(self.raw0)

    def to(self, device: torch.device | str) -> "LinearPreconditioner":
        """The same map with its tensors on ``device`` (a GPU evaluation's: :mod:`refine.solver.graphed`)."""
        return LinearPreconditioner(self.raw0.to(device), self.A.to(device))

    @classmethod
    def identity(cls, raw0: Tensor) -> "LinearPreconditioner":
        return cls(raw0.detach().clone(), torch.eye(raw0.numel(), dtype=raw0.dtype))


def make_preconditioner(kind: str | None, objective: ImageObjective, pmap: ParameterMap, raw0: Tensor) -> LinearPreconditioner:
    """The preconditioner of ``kind`` (None, ``"diagonal"``, ``"full"``) at ``raw0`` for ``objective``'s view."""
    if kind not in PRECONDITIONERS:
        raise InputError(f"precondition: expected one of {PRECONDITIONERS}, got {kind!r}")
    raw0 = raw0.detach().clone()
    if kind is None or raw0.numel() == 0:
        return LinearPreconditioner.identity(raw0)
    return preconditioner_from_fisher(kind, raw_fisher_information(objective, pmap, raw0), raw0)


def raw_fisher_information(objective: ImageObjective, pmap: ParameterMap, raw0: Tensor,
                           fitted_only: bool = False) -> Tensor:
    """(P, P) the Fisher matrix of ``objective``'s pixels in the raw units of ``pmap``'s names at ``raw0``: what
    :func:`make_preconditioner` whitens, and each image's block of a joint run's (:mod:`refine.many.joint`).

    ``fitted_only``: a sparse objective's fitted pixels only (:meth:`ImageObjective.pixel_model`; an objective
    made from fitted pixels has no other), else the view's whole model with weight 0 off the fitted pixels.  With
    amplitudes among the names: the esds' blocked Jacobian on the fitted pixels (bounded memory for hundreds of
    them) with the amplitude restraint's curvature."""
    if any(is_amplitude(n) for n in pmap.names):
        return _blocked_raw_fisher(objective, pmap, raw0)
    sparse = fitted_only and objective.sparse

    def model_fn(raw: Tensor, block: tuple[int, int]) -> Tensor:
        values = pmap.expand(pmap.physical(raw))
        return objective.pixel_model(values) if sparse else objective.model(values)

    def weights_fn(mu: Tensor, block: tuple[int, int]) -> Tensor:
        w = objective.pixel_weights if sparse else objective.weights
        return torch.where(w > 0, w / torch.clamp(mu, min=1e-12), torch.zeros_like(mu))

    return fisher_information(model_fn, raw0, [(0, 0)], weights_fn)


def physical_per_raw(pmap: ParameterMap, raw: Tensor) -> Tensor:
    """(P,) ``d physical / d raw`` of each of ``pmap``'s names at ``raw`` (every transform acts on its own
    coordinate): a matrix in physical units ``F`` is ``D F D`` in raw ones, ``D`` the diagonal of these."""
    # each transform acts on its own coordinate: the Jacobian is diagonal, one forward-mode pass along ones gives it
    # (not the (P, P) matrix: thousands of amplitudes)
    if raw.numel() == 0:
        return raw.new_zeros(0)
    _, d = torch.func.jvp(pmap.physical_vector, (raw,), (torch.ones_like(raw),))
    return d


def _blocked_raw_fisher(objective: ImageObjective, pmap: ParameterMap, raw0: Tensor) -> Tensor:
    """The Fisher matrix in raw units from the esds' blocked Jacobian (:func:`refine.quality.uncertainty.image_information`:
    fitted pixels only, bounded memory for the hundreds of amplitudes), with the amplitude restraint's curvature:
    ``D F D``, ``D = diag(d physical / d raw)`` (:func:`physical_per_raw`)."""
    theta, F, _ = image_information(objective, pmap, raw0)
    add_restraint(F, objective, pmap, theta)
    d = physical_per_raw(pmap, raw0)
    return d[:, None] * F.to(raw0.dtype) * d[None, :]


def diagonal_whitening(diag: Tensor, top: float | None = None) -> Tensor:
    """``1 / sqrt(diag)`` with the diagonal's floor ``1e-12 top`` (``top``: the largest diagonal element, by default
    of ``diag``; a run split over processes passes the largest over all of them; 1 when it is not positive)."""
    top = float(diag.max()) if top is None else float(top)
    floor = 1e-12 * top if top > 0 else 1.0
    return 1.0 / torch.sqrt(torch.clamp(diag, min=floor))


def preconditioner_from_fisher(kind: str | None, F: Tensor, raw0: Tensor) -> LinearPreconditioner:
    """The preconditioner of ``kind`` at ``raw0`` for the Fisher matrix ``F`` in raw units (module docstring);
    :func:`make_preconditioner` computes ``F`` from one image, :mod:`refine.many.joint` sums it over images."""
    if kind not in PRECONDITIONERS:
        raise InputError(f"precondition: expected one of {PRECONDITIONERS}, got {kind!r}")
    raw0 = raw0.detach().clone()
    if kind is None or raw0.numel() == 0:
        return LinearPreconditioner.identity(raw0)
    d = diagonal_whitening(torch.diagonal(F))
    if kind == "diagonal":
        return LinearPreconditioner(raw0, torch.diag(d))
    # unit-diagonal scaling first keeps the eigen-decomposition well conditioned
    Fn = d[:, None] * F * d[None, :]
    lam, V = torch.linalg.eigh(Fn)
    lam = torch.clamp(lam, min=1e-10 * float(lam.max()))
    W = V @ torch.diag(1.0 / torch.sqrt(lam)) @ V.T
    return LinearPreconditioner(raw0, d[:, None] * W)
