"""Estimated standard uncertainties (esds) from the Fisher information of the Poisson likelihood.

For expected counts ``mu_p(theta)`` per pixel and Poisson statistics the Fisher
information of the free physical parameters is the Gauss-Newton matrix

    F = J^T W J,   J_pi = d mu_p / d theta_i,   W = diag(1 / mu_p),

and the covariance of the maximum-likelihood estimate is ``C = F^-1``; the
esd of parameter i is ``sqrt(C_ii)`` and the correlation matrix is
``C_ij / (esd_i esd_j)``.  Units are those of the parameters (:data:`refine.parameters.UNITS`).
The esds are those of a correct model with pure Poisson noise: model errors,
a pedestal that carries no shot noise, or detector gain make the true errors
larger.

``J`` is computed with reverse-mode autograd only (no forward-mode support is
needed from the simulator): ``g(u) = J^T u`` is the gradient of ``u . mu``
with ``create_graph=True``, and ``dg_i / du = J[:, i]``; this costs one
backward pass per parameter on top of one forward pass, done block by block of
image rows so memory stays bounded.  ``F`` is inverted after scaling to unit
diagonal; a (near-)singular ``F`` (degenerate parameters, e.g. cell lengths
and detector distance on a low-angle still) is reported through
:attr:`Uncertainties.condition` and the pseudo-inverse is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

import nbtorch
from torch import Tensor

from refine.objective import ImageObjective, View
from refine.parameters import ORIENTATION_DELTAS, ParameterMap, misset_after_rotation

__all__ = ["Uncertainties", "fisher_information", "estimate_uncertainties"]


@dataclass(frozen=True)
class Uncertainties:
    """Esds and correlations of the free parameters.

    Attributes:
        names: free parameter names, order of the matrices.
        values: (P,) physical values at which F was evaluated.
        esds: (P,) estimated standard uncertainties (physical units).
        covariance: (P, P).
        correlation: (P, P), ones on the diagonal.
        fisher: (P, P) Fisher information.
        condition: condition number of the unit-diagonal Fisher matrix (large = degenerate).
        derived: esds of canonical names implied by the free ones (``cell_b`` for tetragonal,
            ``N_a/N_b/N_c`` for isotropic N, ``misset_x/y/z`` for the orientation).
    """

    names: tuple[str, ...]
    values: np.ndarray
    esds: np.ndarray
    covariance: np.ndarray
    correlation: np.ndarray
    fisher: np.ndarray
    condition: float
    derived: dict

    def as_dict(self) -> dict[str, float]:
        """Name -> esd for the free names and the derived canonical names."""
        out = {n: float(e) for n, e in zip(self.names, self.esds)}
        out.update(self.derived)
        return out


def fisher_information(model_fn: Callable[[Tensor, tuple[int, int]], Tensor], theta: Tensor,
                       rows: Sequence[tuple[int, int]], weights_fn: Callable[[Tensor, tuple[int, int]], Tensor]) -> Tensor:
    """``sum over row blocks of J^T diag(w) J``.

    Arguments:
        model_fn: ``(theta (P,), (row0, row1)) -> mu`` of one block (any shape).
        theta: (P,) physical parameters.
        rows: blocks to sum over.
        weights_fn: ``(mu, block) -> w`` (same shape as mu; 0 = pixel unused).

    Returns: (P, P).
    """
    P = theta.numel()
    F = torch.zeros(P, P, dtype=theta.dtype)
    # double backward does not run through compiled graphs: evaluate eagerly
    with nbtorch.eager():
        for block in rows:
            F += _block_fisher(model_fn, theta, block, weights_fn)
    return F


def _block_fisher(model_fn, theta: Tensor, block: tuple[int, int], weights_fn) -> Tensor:
    """``J^T diag(w) J`` of one block; ``J[:, i] = d g_i / d u`` with ``g = J^T u = grad(u . mu)``."""
    P = theta.numel()
    th = theta.detach().clone().requires_grad_(True)
    mu = model_fn(th, block)
    u = torch.zeros_like(mu, requires_grad=True)
    (g,) = torch.autograd.grad((u * mu).sum(), th, create_graph=True)
    cols = []
    for i in range(P):
        col = None
        if g[i].requires_grad:
            (col,) = torch.autograd.grad(g[i], u, retain_graph=True, allow_unused=True)
        cols.append(torch.zeros_like(mu) if col is None else col)
    J = torch.stack([c.reshape(-1) for c in cols], -1).detach()  # (pixels, P)
    w = weights_fn(mu.detach(), block).reshape(-1)
    return J.T @ (w[:, None] * J)


def _invert(F: Tensor) -> tuple[Tensor, float]:
    d = torch.sqrt(torch.clamp(torch.diagonal(F), min=torch.finfo(F.dtype).tiny))
    Fn = F / (d[:, None] * d[None, :])
    evals = torch.linalg.eigvalsh(Fn)
    cond = float(evals.max() / evals.min()) if float(evals.min()) > 0 else math.inf
    Cn = torch.linalg.pinv(Fn, hermitian=True, rtol=1e-14)
    return Cn / (d[:, None] * d[None, :]), cond


def estimate_uncertainties(objective: ImageObjective, pmap: ParameterMap, raw: Tensor, rows_per_block: int = 64) -> Uncertainties:
    """Esds and correlations of ``pmap``'s free parameters at ``raw`` for the pixels of ``objective``.

    Arguments:
        objective: the image model and view (unbinned, ``n_factor`` 1 for meaningful esds).
        pmap: the parameter map whose free names are estimated.
        raw: (P,) raw parameters (the refined point).
        rows_per_block: image rows per Jacobian block (memory bound).
    """
    names = pmap.names
    with torch.no_grad():
        theta = torch.stack([v.detach() for v in pmap.physical(raw.detach()).values()]) if names else torch.zeros(0)
    view: View = objective.view
    n_rows = view.shape[0]
    step = n_rows if view.bin > 1 else max(int(rows_per_block), 1)  # binned views are evaluated whole
    subs = {}
    for r in range(0, n_rows, step):
        block = (r, min(r + step, n_rows))
        subs[block] = objective if block == (0, n_rows) else objective.rows(*block)

    def model_fn(th: Tensor, block: tuple[int, int]) -> Tensor:
        values = pmap.expand({n: th[i] for i, n in enumerate(names)})
        return subs[block].model(values)

    def weights_fn(mu: Tensor, block: tuple[int, int]) -> Tensor:
        w = subs[block].weights
        return torch.where(w > 0, w / torch.clamp(mu, min=1e-12), torch.zeros_like(mu))

    F = fisher_information(model_fn, theta.to(objective.observed.dtype), list(subs), weights_fn)
    C, cond = _invert(F)
    esds = torch.sqrt(torch.clamp(torch.diagonal(C), min=0.0))
    denom = esds[:, None] * esds[None, :]
    corr = torch.where(denom > 0, C / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(C))
    corr.fill_diagonal_(1.0)
    derived = _derived_esds(pmap, theta, C)
    return Uncertainties(tuple(names), theta.numpy().copy(), esds.numpy().copy(), C.numpy().copy(),
                         corr.numpy().copy(), F.numpy().copy(), cond, derived)


def _derived_esds(pmap: ParameterMap, theta: Tensor, C: Tensor) -> dict[str, float]:
    """Esds of canonical names that follow from the free ones (linear error propagation)."""
    names = list(pmap.names)
    out: dict[str, float] = {}
    idx = {n: i for i, n in enumerate(names)}

    def esd(i: int) -> float:
        return float(torch.sqrt(torch.clamp(C[i, i], min=0.0)))

    implied = {"cell_b": "cell_a", "cell_c": "cell_a", "cell_beta": "cell_alpha", "cell_gamma": "cell_alpha"}
    free_cell = set(names)
    for dep, src in implied.items():
        if dep not in free_cell and src in idx:
            same = pmap.expand({src: theta[idx[src]]})
            if isinstance(same[dep], Tensor):  # tied to src by the symmetry
                out[dep] = esd(idx[src])
    if "N" in idx:
        for k in ("N_a", "N_b", "N_c"):
            out[k] = esd(idx["N"]) * pmap.values[k] / pmap.n0
    if all(n in idx for n in ORIENTATION_DELTAS):
        ii = [idx[n] for n in ORIENTATION_DELTAS]
        misset = torch.tensor([pmap.values[k] for k in ("misset_x", "misset_y", "misset_z")], dtype=torch.float64)
        orient = theta[ii].detach().to(torch.float64)
        A = torch.autograd.functional.jacobian(lambda o: misset_after_rotation(misset, o), orient)
        Cm = A @ C[ii][:, ii].to(torch.float64) @ A.T
        for j, k in enumerate(("misset_x", "misset_y", "misset_z")):
            out[k] = float(torch.sqrt(torch.clamp(Cm[j, j], min=0.0)))
    return out
