"""A joint run's preconditioner (:mod:`refine.many.joint`): the joint Fisher matrix at the start, by its
arrowhead's blocks (:mod:`refine.many.schur`) or its diagonal, or none; each image's factors on the process
that holds it (:mod:`refine.many.sharded`); and its record in a checkpoint.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch
from torch import Tensor

from refine.fitting.structure_factors import is_amplitude
from refine.many.checkpoint import ImageRows
from refine.many.exact_sum import exact_sums
from refine.many.schur import ArrowheadPreconditioner, arrowhead_factors, arrowhead_preconditioner
from refine.many.sparse_amplitudes import sparse_preconditioner
from refine.quality.uncertainty import image_information
from refine.solver.precondition import diagonal_whitening, physical_per_raw, raw_fisher_information
from refine.many.joint_images import Joint, JointImage


log = logging.getLogger(__name__)



def joint_preconditioner(kind: str | None, joint: Joint, raw0: Tensor) -> ArrowheadPreconditioner:
    """Whitening by the joint Fisher matrix at the start (``full``: by its arrowhead's blocks,
    :mod:`refine.many.schur`), by its diagonal, or none, on this process's part of the raw vector: each held
    image's block in raw units of ``[shared, own]`` (a single run's, on its fitted pixels) stays on its process;
    the shared block is summed exactly over every process's images (the same bits for any number of processes)."""
    if joint.tail is not None:  # many amplitudes: their diagonal (refine.many.sparse_amplitudes)
        return sparse_preconditioner(kind, joint, raw0)
    S, K = joint.S, joint.K
    held_images = sorted(joint.slots)
    if kind is None:
        eye = torch.eye(K, dtype=raw0.dtype)
        return ArrowheadPreconditioner(raw0.detach().clone(), torch.eye(S, dtype=raw0.dtype),
                                       eye.expand(len(held_images), K, K).clone(),
                                       torch.zeros(len(held_images), K, S, dtype=raw0.dtype))
    local = {im.index: _raw_fisher(im, joint.image_raw(raw0, im.index)) for im in joint.images}
    extra = joint.curvature(raw0.as_subclass(Tensor)[:S], True) if joint.curvature is not None else None
    if kind == "diagonal":
        return _diagonal(joint, [local[i] for i in held_images], raw0, extra)
    return _arrowhead(joint, local, raw0, extra)


def _diagonal(joint: Joint, blocks: list[Tensor], raw0: Tensor, extra: Tensor | None) -> ArrowheadPreconditioner:
    """The diagonal of the joint Fisher matrix (:func:`~refine.solver.precondition.preconditioner_from_fisher`'s
    ``diagonal``, the same floor), as arrowhead factors without coupling."""
    S, K, dt = joint.S, joint.K, raw0.dtype
    diags = torch.stack([torch.diagonal(F) for F in blocks]) if blocks else torch.zeros(0, S + K, dtype=dt)
    shared = exact_sums(diags[:, :S], joint.vector.layout.reduce_sum).to(dt)
    if extra is not None:
        shared = shared + torch.diagonal(extra).to(dt)
    diag = torch.cat([shared, diags[:, S:].reshape(-1)])
    diag[joint.held_local()] = 1.0  # a held position: one raw unit, never moved (its gradient is 0)
    w = diagonal_whitening(diag, float(diag.as_subclass(joint.vector).max()))  # the largest over every process
    return ArrowheadPreconditioner(raw0.detach().clone(), torch.diag(w[:S]),
                                   torch.diag_embed(w[S:].reshape(-1, K)), torch.zeros(len(blocks), K, S, dtype=dt))


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
    process (its ``(K, K)`` and ``(K, S)`` factors stay there), the ``(S, S)`` Schur contributions summed exactly
    over every process's images."""
    S, K = joint.S, joint.K
    held = {(h - S) // K: (h - S) % K for h in joint.held}
    order = sorted(joint.slots)
    parts = [arrowhead_factors(local[i], S, held.get(i)) for i in order]
    W = torch.stack([p[0] for p in parts]) if parts else torch.zeros(0, K, K, dtype=raw0.dtype)
    G = torch.stack([p[1] for p in parts]) if parts else torch.zeros(0, K, S, dtype=raw0.dtype)
    schur = torch.stack([p[2].reshape(-1) for p in parts]) if parts else torch.zeros(0, S * S, dtype=raw0.dtype)
    total = exact_sums(schur, joint.vector.layout.reduce_sum).to(raw0.dtype).reshape(1, S, S)
    return arrowhead_preconditioner(raw0, (W, G, total), extra)


def precond_state(pre: ArrowheadPreconditioner) -> dict:
    """A checkpoint's record of the loop's preconditioner (the arrowhead's factors; ``W`` and ``G`` one row per
    held image: :class:`~refine.many.checkpoint.ImageRows`)."""
    return {**pre.to_dict(), "W": ImageRows(pre.W), "G": ImageRows(pre.G)}


def precond_from_state(state: Mapping[str, Tensor]):
    """The preconditioner a checkpoint recorded (:func:`precond_state`)."""
    if state.get("kind") == "arrowhead":
        return ArrowheadPreconditioner(state["raw0"], state["Ws"], state["W"], state["G"], state.get("tail"))
    raise ValueError("not an arrowhead preconditioner")
