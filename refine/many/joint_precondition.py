"""A joint run's preconditioner (:mod:`refine.many.joint`): the joint Fisher matrix at the start, dense,
diagonal or by its arrowhead's blocks (:mod:`refine.many.schur`), and its record in a checkpoint.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch
from torch import Tensor

from refine.fitting.structure_factors import is_amplitude
from refine.many.esds import MAX_DENSE, assemble
from refine.many.schur import ArrowheadPreconditioner, arrowhead_factors, arrowhead_preconditioner
from refine.quality.uncertainty import image_information
from refine.solver.precondition import (LinearPreconditioner, physical_per_raw, preconditioner_from_fisher,
                                        raw_fisher_information)
from refine.many.joint_images import Joint, JointImage


log = logging.getLogger(__name__)



def joint_preconditioner(kind: str | None, joint: Joint, raw0: Tensor) -> LinearPreconditioner:
    """Whitening by the joint Fisher matrix at the start (``full``), or its diagonal: each image's block in raw
    units of ``[shared, own]`` (a single run's, on its fitted pixels) gathered and assembled."""
    if kind is None:
        return LinearPreconditioner.identity(raw0)
    q = joint.S + joint.K
    local = {im.index: _raw_fisher(im, joint.image_raw(raw0, im.index)) for im in joint.images}
    extra = joint.curvature(raw0[:joint.S], True) if joint.curvature is not None else None
    if kind == "full" and raw0.numel() > MAX_DENSE:
        log.info("joint: %d raw parameters > %d: arrowhead (Schur complement) preconditioning", raw0.numel(),
                 MAX_DENSE)
        return _arrowhead(joint, local, raw0, extra)
    blocks = joint.comm.gather(local, joint.n, (q, q), raw0.dtype)
    if kind == "diagonal":
        diag = torch.cat([torch.diagonal(blocks[:, :joint.S, :joint.S], dim1=1, dim2=2).sum(0),
                          torch.diagonal(blocks[:, joint.S:, joint.S:], dim1=1, dim2=2).reshape(-1)])
        if extra is not None:
            diag[:joint.S] += torch.diagonal(extra).to(diag.dtype)
        diag[joint.held] = 1.0  # a held position: one raw unit, never moved (its gradient is 0)
        return preconditioner_from_fisher("diagonal", torch.diag(diag), raw0)
    F = assemble(blocks, joint.S)
    if extra is not None:
        F[:joint.S, :joint.S] += extra.to(F.dtype)
    for k in joint.held:
        F[k, :], F[:, k] = 0.0, 0.0
        F[k, k] = 1.0
    return preconditioner_from_fisher(kind, F, raw0)



def _raw_fisher(im: JointImage, raw: Tensor) -> Tensor:
    """The image's Fisher block in raw units of ``[shared, own]`` on its fitted pixels: from the esds' Jacobian
    (:func:`~refine.quality.uncertainty.image_information`, ``D F D`` with ``D = d physical / d raw``; the same
    matrix as :func:`raw_fisher_information`'s forward-mode one to rounding, about 10x faster on a 64 x 64 still);
    with amplitudes among the names, :func:`raw_fisher_information` (their restraint)."""
    if any(is_amplitude(n) for n in im.pmap.names):
        return raw_fisher_information(im.objective, im.pmap, raw, fitted_only=True)
    _, F, _ = image_information(im.objective, im.pmap, raw)
    d = physical_per_raw(im.pmap, raw)
    return d[:, None] * F.to(raw.dtype) * d[None, :]


def _arrowhead(joint: Joint, local: Mapping[int, Tensor], raw0: Tensor,
               extra: Tensor | None) -> ArrowheadPreconditioner:
    """The arrowhead preconditioner (:mod:`refine.many.schur`): each image's own block eliminated on its
    process, the ``(K, K)``, ``(K, S)`` and ``(S, S)`` factors gathered exactly and summed in image order."""
    S, K, n = joint.S, joint.K, joint.n
    held = {(h - S) // K: (h - S) % K for h in joint.held}
    parts = {i: arrowhead_factors(F, S, held.get(i)) for i, F in local.items()}
    W = joint.comm.gather({i: p[0] for i, p in parts.items()}, n, (K, K), raw0.dtype)
    G = joint.comm.gather({i: p[1] for i, p in parts.items()}, n, (K, S), raw0.dtype)
    schur = joint.comm.gather({i: p[2] for i, p in parts.items()}, n, (S, S), raw0.dtype)
    return arrowhead_preconditioner(raw0, (W, G, schur), extra)


def precond_state(pre) -> dict:
    """A checkpoint's record of the loop's preconditioner (dense ``A`` or the arrowhead's factors)."""
    return pre.to_dict() if isinstance(pre, ArrowheadPreconditioner) else {"raw0": pre.raw0, "A": pre.A}


def precond_from_state(state: Mapping[str, Tensor]):
    """The preconditioner a checkpoint recorded (:func:`precond_state`)."""
    if state.get("kind") == "arrowhead":
        return ArrowheadPreconditioner(state["raw0"], state["Ws"], state["W"], state["G"])
    return LinearPreconditioner(state["raw0"], state["A"])
