"""Estimated standard uncertainties (esds) from the Fisher information of the Poisson likelihood.

For expected counts ``mu_p(theta)`` per pixel and Poisson statistics the Fisher
information of the free physical parameters is the Gauss-Newton matrix

    F = J^T W J,   J_pi = d mu_p / d theta_i,   W = diag(1 / mu_p),

and the covariance of the maximum-likelihood estimate is ``C = F^-1``; the
esd of parameter i is ``sqrt(C_ii)`` and the correlation matrix is
``C_ij / (esd_i esd_j)``.  Units are those of the parameters (:data:`refine.fitting.parameters.UNITS`).
The esds are those of a correct model with pure Poisson noise: model errors,
a pedestal that carries no shot noise, or detector gain make the true errors
larger.

Three covariances are reported (``Uncertainties.kinds``):

* ``fisher``: ``C = F^-1``, right when the model is right and the noise is Poisson;
* ``scaled``: ``C * max(1, excess)``, where ``excess`` is the final loss over its shot-noise
  expectation (:mod:`refine.quality.fit_quality`): a model that misses part of the image inflates the
  residuals by that factor on average;
* ``sandwich`` (the default, what ``result.json``'s ``esds`` and the printed table hold): the robust
  covariance ``F^-1 B F^-1`` with ``B = sum_k s_k s_k^T`` over clusters ``k`` of pixels, ``s_k`` the
  sum over the cluster of the pixels' scores ``J_p w_p (y_p - mu_p) / mu_p`` (Huber-White, with
  clusters).  It needs no assumption that the model is right; the clusters (squares of
  ``cluster_px`` pixels, 8 by default: about a spot) let the misfit of neighbouring pixels be
  correlated, as the misfit of one reflection's spot is.  ``B`` is estimated from the clusters,
  so they must far outnumber the parameters: the side is halved (8, 4, 2, 1) until there are at
  least 30 non-empty clusters per free parameter.  For a right model it equals ``fisher``
  on average (checked over noisy realisations: ``tests/refine/test_esd_calibration.py``).

``J`` is computed from first derivatives only, by forward-mode autograd
(:func:`pixel_jacobian`): one eager pass of the model carrying the P tangents at once
(:func:`torch.func.jacfwd`), the simulator's hot loop through its analytic derivative
(:func:`nbtorch.physics.square_sum.square_sum_jvp`).  Nothing here needs second derivatives: ``F``,
``B`` and the priors' curvature are all built from ``J``.  A sparse objective (the fitted pixels only,
:class:`~refine.fitting.objective.ImageObjective`) is evaluated on its fitted pixels, in blocks of whole rows
so memory stays bounded.  ``F`` is inverted after scaling to unit
diagonal; a (near-)singular ``F`` (degenerate parameters, e.g. cell lengths
and detector distance on a low-angle still) is reported through
:attr:`Uncertainties.condition` and the pseudo-inverse is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

import nbtorch
from torch import Tensor

from nbtorch.runtime.jacobian_kernels import JACOBIAN_TILE_EVALUATIONS, forward_mode
from nbtorch.parameters import SIZE_DIAGONAL, SIZE_OFF_DIAGONAL
from refine.fitting.objective import ImageObjective, View
from refine.fitting.parameters import ORIENTATION_DELTAS, ParameterMap, misset_after_rotation
from refine.fitting.structure_factors import is_amplitude

__all__ = ["Uncertainties", "pixel_jacobian", "reverse_pixel_jacobian", "fisher_information", "information_matrices",
           "cluster_scores", "estimate_uncertainties", "image_information", "ESD_KINDS", "derived_esds",
           "invert_information", "add_restraint", "restraint_curvature", "standard_errors", "correlation_matrix",
           "named_esds"]


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
    kinds: dict = field(default_factory=dict)
    kind: str = "fisher"

    def as_dict(self, kind: str | None = None) -> dict[str, float]:
        """Name -> esd for the free names and the derived canonical names; ``kind`` one of ``kinds``
        (``fisher``, ``scaled``, ``sandwich``; None = the default one, ``kind``)."""
        if kind is not None and kind != self.kind:
            if kind not in self.kinds:
                raise KeyError(f"no {kind!r} esds; have {', '.join(self.kinds)}")
            return dict(self.kinds[kind])
        out = {n: float(e) for n, e in zip(self.names, self.esds)}
        out.update(self.derived)
        return out


def pixel_jacobian(model_fn: Callable[[Tensor], Tensor], theta: Tensor) -> tuple[Tensor, Tensor]:
    """``(mu, J)``: the model ``model_fn(theta)`` (any shape) and its Jacobian (pixels, P), pixels flattened.

    First derivatives only, by forward-mode autograd: one pass of the model with the P tangents
    batched (:func:`torch.func.jacfwd`), the simulator's hot loop through its analytic derivative
    (:func:`nbtorch.runtime.jacobian_kernels.forward_mode`).  Run eagerly (a compiled graph would drop the tangents),
    except that, unless compiling is off (inside ``nbtorch.eager()`` or by the environment variable), each
    large tile goes through the compiled forward-mode kernels of :mod:`nbtorch.physics.jacobian`.
    """
    th = theta.detach()
    with forward_mode(), torch.no_grad():
        if th.numel() == 0:
            mu = model_fn(th)
            return mu, mu.new_zeros(mu.numel(), 0)

        def both(t: Tensor) -> tuple[Tensor, Tensor]:
            out = model_fn(t)
            return out.reshape(-1), out

        J, mu = torch.func.jacfwd(both, has_aux=True)(th)
    return mu.detach(), J.detach()


#: blocks of fewer lattice-factor evaluations than this take their Jacobian by reverse mode
#: (:func:`reverse_pixel_jacobian`): where the compiled forward-mode kernels never apply, that is faster
REVERSE_JACOBIAN_EVALUATIONS = JACOBIAN_TILE_EVALUATIONS


def reverse_pixel_jacobian(model_fn: Callable[[Tensor], Tensor], theta: Tensor) -> tuple[Tensor, Tensor]:
    """``(mu, J)`` as :func:`pixel_jacobian`, by reverse mode only: ``g = J^T v`` is linear in ``v``, so column
    ``i`` of ``J`` is the derivative of ``g_i`` in ``v``: one forward pass, one backward pass that records its
    own graph, and one backward pass of that per parameter, eagerly.

    Used for small blocks (:data:`REVERSE_JACOBIAN_EVALUATIONS`), where it is faster than forward mode: torch's
    eager forward-mode derivatives run its Python references (``torch._refs``) for every operation that mixes
    a tensor carrying tangents with a constant, and their first call imports ``torch._dynamo`` (the README's
    main job: 0.57 s for its first Jacobian instead of 1.99 s, 0.23 s instead of 0.29 s later; the same J to
    3e-15 relative)."""
    th0 = theta.detach()
    with nbtorch.eager(), torch.enable_grad():
        th = th0.clone().requires_grad_(True)
        out = model_fn(th)
        flat = out.reshape(-1)
        if th.numel() == 0:
            return out.detach(), flat.new_zeros(flat.numel(), 0).detach()
        v = torch.zeros_like(flat, requires_grad=True)
        (g,) = torch.autograd.grad(flat, th, v, create_graph=True, allow_unused=True)
        cols = []
        for i in range(th.numel()):
            col = None
            if g is not None and g[i].requires_grad:
                (col,) = torch.autograd.grad(g[i], v, retain_graph=True, allow_unused=True)
            cols.append(flat.new_zeros(flat.numel()) if col is None else col.detach())
    return out.detach(), torch.stack(cols, -1)


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
    for block in rows:
        mu, J = pixel_jacobian(lambda th: model_fn(th, block), theta)
        w = weights_fn(mu, block).reshape(-1)
        F += (J.T @ (w[:, None] * J)).to(F.device)  # J on the model's device (a GPU), F beside theta
    return F


def cluster_index(flat: Tensor, shape: tuple[int, int], cluster_px: int) -> tuple[Tensor, int]:
    """``(index, count)``: the square of ``cluster_px`` pixels each pixel at row-major position ``flat`` of an image
    of ``shape`` (rows, columns) falls in, and the number of squares (the last ones partial)."""
    rows, cols = shape
    k = max(int(cluster_px), 1)
    across = -(-cols // k)
    return (flat // cols // k) * across + (flat % cols) // k, (-(-rows // k)) * across


def cluster_scores(J: Tensor, factor: Tensor, shape: tuple[int, int], cluster_px: int) -> Tensor:
    """(clusters, P): the sums of the per-pixel scores ``J_p * factor_p`` over squares of ``cluster_px`` pixels
    of an image block of ``shape`` (rows, columns; pixels row-major as in ``J``)."""
    index, count = cluster_index(torch.arange(J.shape[0], device=J.device), shape, cluster_px)
    return _sum_scores(J, factor.reshape(-1), index, count)


def _sum_scores(J: Tensor, factor: Tensor, index: Tensor, count: int) -> Tensor:
    return J.new_zeros(count, J.shape[1]).index_add_(0, index, J * factor[:, None])


@dataclass(frozen=True)
class _Block:
    """Pixels of one block: ``model(theta) -> mu`` (flattened), their observed counts and weights (flattened),
    each pixel's cluster (``cluster`` (pixels,), ``clusters`` in all) and the lattice-factor evaluations of one
    model call (which Jacobian it takes: :func:`_add_information`)."""

    model: Callable[[Tensor], Tensor]
    observed: Tensor
    weights: Tensor
    cluster: Tensor
    clusters: int
    evaluations: int  # lattice-factor evaluations of one model call


def _add_information(F: Tensor, B: Tensor, block: _Block, theta: Tensor) -> None:
    """``F += J^T diag(w / mu) J`` and ``B += S^T S`` (clustered Poisson scores) of one block; the Jacobian on the
    block's device (a GPU's: the tangents of ``theta`` meet the model there), ``F`` and ``B`` where they are; by
    reverse mode for a small block (:data:`REVERSE_JACOBIAN_EVALUATIONS`), else by forward mode."""
    jacobian = reverse_pixel_jacobian if block.evaluations < REVERSE_JACOBIAN_EVALUATIONS else pixel_jacobian
    mu, J = jacobian(block.model, theta.to(block.observed.device))
    _accumulate(F, B, mu.reshape(-1), J, block.observed, block.weights, block.cluster, block.clusters)


def _accumulate(F: Tensor, B: Tensor, mu: Tensor, J: Tensor, observed: Tensor, w: Tensor, cluster: Tensor,
                clusters: int) -> None:
    safe = torch.clamp(mu, min=1e-12)
    inv = torch.where(w > 0, w / safe, torch.zeros_like(mu))
    F += (J.T @ (inv[:, None] * J)).to(F.device)
    factor = torch.where(w > 0, w * (observed - mu) / safe, torch.zeros_like(mu))
    S = _sum_scores(J, factor, cluster.to(J.device), clusters)
    B += (S.T @ S).to(B.device)


def information_matrices(model_fn, theta: Tensor, rows: Sequence[tuple[int, int]], weights_fn, observed_fn,
                         cluster_px: int = 8) -> tuple[Tensor, Tensor]:
    """``F = sum J^T diag(w / mu) J`` and ``B = sum_k s_k s_k^T`` (clustered Poisson scores, module docstring).

    Arguments as :func:`fisher_information`, with ``weights_fn(mu, block)`` the pixel weights (0/1, not divided
    by ``mu``), ``observed_fn(block)`` the observed counts of the block (the shape of ``mu``).
    """
    P = theta.numel()
    F = torch.zeros(P, P, dtype=theta.dtype)
    B = torch.zeros(P, P, dtype=theta.dtype)
    for block in rows:
        mu, J = pixel_jacobian(lambda th: model_fn(th, block), theta)
        shape = tuple(mu.shape[-2:]) if mu.dim() >= 2 else (1, mu.numel())
        index, count = cluster_index(torch.arange(mu.numel()), shape, cluster_px)
        _accumulate(F, B, mu.reshape(-1), J, observed_fn(block).reshape(-1), weights_fn(mu, block).reshape(-1),
                    index, count)
    return F, B


def pseudo_inverse(F: Tensor) -> tuple[Tensor, Tensor, float]:
    """``(C, blind, condition)``: the pseudo-inverse of an information matrix (scaled to unit diagonal first),
    with the rows and columns of ``blind`` parameters (no information: a zero diagonal) set to 0 (finite, so
    it can enter further products), and the condition number of the scaled matrix (inf when singular)."""
    d = torch.sqrt(torch.clamp(torch.diagonal(F), min=torch.finfo(F.dtype).tiny))
    Fn = F / (d[:, None] * d[None, :])
    evals = torch.linalg.eigvalsh(Fn)
    cond = float(evals.max() / evals.min()) if float(evals.min()) > 0 else math.inf
    Cn = torch.linalg.pinv(Fn, hermitian=True, rtol=1e-14)
    C = Cn / (d[:, None] * d[None, :])
    blind = torch.diagonal(F) <= 1e-14 * float(torch.diagonal(F).abs().max().clamp(min=torch.finfo(F.dtype).tiny))
    if bool(blind.any()):
        C = C.clone()
        C[blind, :] = 0.0
        C[:, blind] = 0.0
    return C, blind, cond


def mark_blind(C: Tensor, blind: Tensor) -> Tensor:
    """``C`` with an infinite variance at the ``blind`` parameters (their rows and columns 0 otherwise)."""
    if not bool(blind.any()):
        return C
    C = C.clone()
    C[blind, :] = 0.0
    C[:, blind] = 0.0
    C[blind, blind] = math.inf
    return C


def invert_information(F: Tensor) -> tuple[Tensor, float]:
    """``(C, condition)``: the covariance from an information matrix.  A parameter the data say nothing about
    (e.g. an amplitude refined to 0, where the image does not depend on it to first order) has no esd:
    infinite, not the 0 of the pseudo-inverse."""
    C, blind, cond = pseudo_inverse(F)
    return mark_blind(C, blind), cond


ESD_KINDS = ("sandwich", "scaled", "fisher")


def estimate_uncertainties(objective: ImageObjective, pmap: ParameterMap, raw: Tensor,
                           rows_per_block: int | None = None,
                           *, excess: float | None = None, cluster_px: int = 8,
                           kind: str = "sandwich") -> Uncertainties:
    """Esds and correlations of ``pmap``'s free parameters at ``raw`` for the pixels of ``objective``.

    Arguments:
        objective: the image model and view (unbinned, ``n_factor`` 1 for meaningful esds).
        pmap: the parameter map whose free names are estimated.
        raw: (P,) raw parameters (the refined point).
        rows_per_block: image rows per Jacobian block (memory bound; rounded to a multiple of
            ``cluster_px`` so that no cluster straddles two blocks); None: 64, or when the objective
            is sparse the rows of about :data:`PIXELS_PER_BLOCK` fitted pixels.
        excess: the fit's loss over its shot-noise expectation, for the ``scaled`` esds (None: 1).
        cluster_px: side of the pixel squares of the sandwich's clusters.
        kind: which covariance is the result's (``esds``, ``covariance``, ``correlation``):
            ``sandwich`` (default), ``scaled`` or ``fisher``; all three are in ``kinds``.
    """
    if kind not in ESD_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(ESD_KINDS)}, got {kind!r}")
    names = pmap.names
    theta, F, B = image_information(objective, pmap, raw, rows_per_block, cluster_px=cluster_px)
    # Gaussian priors add their curvature 1 / sigma^2 (their own units), the amplitude restraint its Gauss-Newton
    # curvature; to the meat of the sandwich too (a restraint is a pseudo-observation whose score variance is its
    # curvature), so that a parameter the restraint decides gets the restraint's esd, not ~0
    restraints = torch.zeros_like(F)
    for i, name in enumerate(names):
        if name in objective.priors:
            restraints[i, i] += 1.0 / objective.priors[name][1] ** 2
    add_restraint(restraints, objective, pmap, theta)
    F = F + restraints
    B = B + restraints
    C_fisher, cond = invert_information(F)
    covariances = {"fisher": C_fisher, "scaled": C_fisher * max(1.0, float(excess) if excess is not None else 1.0),
                   "sandwich": C_fisher @ B @ C_fisher}
    kinds = {name: named_esds(pmap, theta, C) for name, C in covariances.items()}
    C = covariances[kind]
    esds = standard_errors(C)
    corr = correlation_matrix(C)
    derived = derived_esds(pmap, theta, C)
    return Uncertainties(tuple(names), theta.numpy().copy(), esds.numpy().copy(), C.numpy().copy(),
                         corr.numpy().copy(), F.numpy().copy(), cond, derived, kinds, kind)


def standard_errors(C: Tensor) -> Tensor:
    """(P,) the esds of a covariance matrix: the square roots of its diagonal (negative rounding clamped to 0)."""
    return torch.sqrt(torch.clamp(torch.diagonal(C), min=0.0))


def correlation_matrix(C: Tensor) -> Tensor:
    """(P, P) the correlation matrix of a covariance matrix: ones on the diagonal, 0 where an esd is 0."""
    esds = standard_errors(C)
    denom = esds[:, None] * esds[None, :]
    corr = torch.where(denom > 0, C / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(C))
    corr.fill_diagonal_(1.0)
    return corr


def named_esds(pmap: ParameterMap, theta: Tensor, C: Tensor) -> dict[str, float]:
    """Name -> esd of ``pmap``'s free names from their covariance ``C`` at ``theta``, and of the canonical names
    tied to them (:func:`derived_esds`)."""
    return {n: float(e) for n, e in zip(pmap.names, standard_errors(C))} | derived_esds(pmap, theta, C)


def restraint_curvature(restraint, names: Sequence[str], values: dict, raw_scale: Tensor | None = None) -> Tensor:
    """(P, P) the Gauss-Newton curvature ``R^T R`` of an amplitude restraint
    (:class:`refine.fitting.structure_factors.AmplitudeRestraint`, or None: zeros) on the rows of the amplitudes
    among ``names`` at ``values`` (every table entry's value; the held ones at theirs), in physical units, or in
    raw units with ``raw_scale`` ((P,) d physical / d raw of each name)."""
    out = torch.zeros(len(names), len(names), dtype=torch.float64)
    if restraint is None:
        return out
    table = restraint.table
    free = [(i, table.names.index(n)) for i, n in enumerate(names) if is_amplitude(n)]
    if not free:
        return out
    R = restraint.jacobian(table.vector(values, torch.float64, "cpu"))[:, [j for _, j in free]]
    if raw_scale is not None:
        R = R * raw_scale[[i for i, _ in free]][None, :]
    rows = torch.tensor([i for i, _ in free])
    out[rows[:, None], rows[None, :]] = R.T @ R
    return out


def add_restraint(F: Tensor, objective: ImageObjective, pmap: ParameterMap, theta: Tensor) -> None:
    """``F += `` the objective's amplitude restraint's curvature (:func:`restraint_curvature`) on the rows of
    ``pmap``'s free amplitudes at ``theta`` (the held ones at their values in ``pmap``)."""
    if objective.restraint is None or not any(is_amplitude(n) for n in pmap.names):
        return
    values = pmap.expand({n: float(t) for n, t in zip(pmap.names, theta)})
    F += restraint_curvature(objective.restraint, pmap.names, values).to(F.dtype)


def image_information(objective: ImageObjective, pmap: ParameterMap, raw: Tensor, rows_per_block: int | None = None,
                      *, cluster_px: int = 8) -> tuple[Tensor, Tensor, Tensor]:
    """``(theta, F, B)`` of one image: the physical values (P,) of ``pmap``'s free names at ``raw``, the Fisher
    matrix ``F`` and the clustered score matrix ``B`` (:func:`information_matrices`; priors not included), in
    the units of the names.  :func:`estimate_uncertainties` inverts them; a joint refinement
    (:mod:`refine.many.joint`) sums them over images first."""
    # an amplitude is seen by one spot (a cluster or a few) by construction: the clusters are counted against
    # the other parameters (refine.fitting.structure_factors)
    cluster_px = _cluster_side(objective, sum(1 for n in pmap.names if not is_amplitude(n)), cluster_px)
    names = pmap.names
    with torch.no_grad():
        theta = torch.stack([v.detach() for v in pmap.physical(raw.detach()).values()]) if names else torch.zeros(0)
    theta = theta.to(objective.dtype)
    P = len(names)
    F = torch.zeros(P, P, dtype=theta.dtype)
    B = torch.zeros(P, P, dtype=theta.dtype)
    for block in _blocks(objective, pmap, rows_per_block, cluster_px):
        _add_information(F, B, block, theta)
    return theta, F, B


#: fitted pixels per Jacobian block of a sparse objective (rows_per_block None)
PIXELS_PER_BLOCK = 1 << 16


def _blocks(objective: ImageObjective, pmap: ParameterMap, rows_per_block: int | None, k: int) -> list[_Block]:
    """The objective's pixels in blocks of whole rows (a multiple of ``k``, the cluster side; binned views whole)."""
    view: View = objective.view
    n_rows = view.shape[0]
    if rows_per_block is None:  # about PIXELS_PER_BLOCK x 32 Jacobian entries per block
        per_row = objective.n_pixels / n_rows if objective.sparse else view.shape[1]
        pixels = PIXELS_PER_BLOCK * min(1.0, 32.0 / max(len(pmap.names), 1))
        rows_per_block = max(1, int(pixels / max(per_row, 1.0)))
    step = n_rows if view.bin > 1 else max(k, (int(rows_per_block) // k) * k)
    out = []
    for r in range(0, n_rows, step):
        sub = objective if (r, min(r + step, n_rows)) == (0, n_rows) else objective.rows(r, min(r + step, n_rows))
        out.append(_sparse_block(sub, pmap, k) if sub.sparse else _image_block(sub, pmap, k))
    return out


def _values(pmap: ParameterMap, th: Tensor) -> dict:
    return pmap.expand({n: th[i] for i, n in enumerate(pmap.names)})


def _sparse_block(sub: ImageObjective, pmap: ParameterMap, k: int) -> _Block:
    """The fitted pixels of ``sub`` only (:meth:`ImageObjective.pixel_model`)."""
    index, count = cluster_index(sub.used_pixels, sub.view.shape, k)
    return _Block(lambda th: sub.pixel_model(_values(pmap, th)), sub.observed_pixels, sub.pixel_weights, index, count,
                  sub.observed_pixels.numel() * sub.sim.evaluations_per_pixel())


def _image_block(sub: ImageObjective, pmap: ParameterMap, k: int) -> _Block:
    """The (binned) image of ``sub`` (:meth:`ImageObjective.model`)."""
    shape = tuple(sub.weights.shape[-2:]) if sub.weights.dim() >= 2 else (1, sub.weights.numel())
    index, count = cluster_index(torch.arange(sub.weights.numel(), device=sub.weights.device), shape, k)
    return _Block(lambda th: sub.model(_values(pmap, th)), sub.observed.reshape(-1), sub.weights.reshape(-1),
                  index, count, sub.weights.numel() * sub.view.bin ** 2 * sub.sim.evaluations_per_pixel())


def _cluster_side(objective: ImageObjective, n_free: int, largest: int) -> int:
    """The largest square side (``largest``, halved down to 1) giving >= 30 non-empty clusters per parameter."""
    if objective.sparse:  # the fitted positions (an objective on positions holds no mask)
        flat, shape = objective.used_pixels, objective.view.shape
    else:
        used = (objective.weights > 0).reshape(objective.weights.shape[-2:]) if objective.weights.dim() >= 2 \
            else (objective.weights > 0).reshape(1, -1)
        flat, shape = torch.nonzero(used.reshape(-1)).reshape(-1), tuple(used.shape)
    side = max(int(largest), 1)
    while side > 1:
        if torch.unique(cluster_index(flat, shape, side)[0]).numel() >= 30 * max(n_free, 1):
            break
        side //= 2
    return side


def derived_esds(pmap: ParameterMap, theta: Tensor, C: Tensor) -> dict[str, float]:
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
        for k in SIZE_DIAGONAL + tuple(k for k in SIZE_OFF_DIAGONAL if k not in idx and pmap.values[k] != 0):
            out[k] = esd(idx["N"]) * abs(pmap.values[k]) / pmap.n0
    if all(n in idx for n in ORIENTATION_DELTAS):
        ii = [idx[n] for n in ORIENTATION_DELTAS]
        misset = torch.tensor([pmap.values[k] for k in ("misset_x", "misset_y", "misset_z")], dtype=torch.float64)
        orient = theta[ii].detach().to(torch.float64)
        A = torch.autograd.functional.jacobian(lambda o: misset_after_rotation(misset, o), orient)
        Cm = A @ C[ii][:, ii].to(torch.float64) @ A.T
        for j, k in enumerate(("misset_x", "misset_y", "misset_z")):
            out[k] = float(torch.sqrt(torch.clamp(Cm[j, j], min=0.0)))
    return out
