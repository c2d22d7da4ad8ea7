"""Esds of a joint refinement: the joint Fisher and sandwich covariances from per-image blocks.

Each image ``i`` contributes its Fisher matrix ``F_i`` and clustered score matrix ``M_i`` (the sandwich's
meat) over its ``[shared, own]`` raw names (``q = S + K``; :func:`refine.quality.uncertainty.image_information`).
The joint matrices have an arrowhead structure: the shared-shared block is the sum over images (plus a
restraint's curvature ``R``, once), each image's own block and its coupling to the shared names are its own,
two images' own names are not coupled::

        | A    B_1  ...  B_n |        A   = sum_i F_i[s, s] + R
    F = | B_1' D_1           |        B_i = F_i[s, own],  D_i = F_i[own, own]
        | ...       ...      |
        | B_n'           D_n |

Up to :data:`MAX_DENSE` raw parameters the covariances are computed densely (``F^-1`` and ``F^-1 M F^-1``
with a scaled pseudo-inverse, :func:`refine.quality.uncertainty.invert_information`).  Above it, only the blocks the
esds need (shared-shared and each image's own block) are computed from the blocks, in memory and time
linear in the number of images, by the Schur complement of the own blocks::

    C_ss = (A - sum_i B_i D_i^-1 B_i')^-1                    (Fisher, shared)
    U_i  = -D_i^-1 B_i' C_ss                                 (Fisher, own-shared)
    C_ii = D_i^-1 - U_i B_i D_i^-1                           (Fisher, own)
    T_j  = [I, -B_j D_j^-1],  Q = sum_j T_j M_j T_j' + R
    S_ss = C_ss Q C_ss                                       (sandwich, shared)
    S_ii = U_i Q U_i' + E_i M_i E_i' + U_i T_i M_i E_i' + (..)'  with E_i = [0, D_i^-1]

(the sandwich's rows of ``F^-1`` restricted to image ``j``'s names are ``C_ss T_j`` for the shared names and
``U_i T_j`` (+ ``E_i`` when ``j = i``) for image ``i``'s).  The two paths agree to rounding on well-conditioned
problems (``tests/refine/test_joint_esds.py``).  Held positions (image 0's scale beside shared structure
factors) are left out of both; parameters without information get an infinite esd in both.  The reported
condition number above :data:`MAX_DENSE` is the largest of the Schur complement's and the own blocks'
(each scaled to a unit diagonal), not that of the whole matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from refine.many.schur import eliminate, own_covariances
from refine.quality.uncertainty import mark_blind, pseudo_inverse

#: raw parameters of a joint refinement above which its matrices are not built densely
MAX_DENSE = 4000


@dataclass(frozen=True)
class JointCovariances:
    """The covariance blocks the esds need, for one kind (``fisher`` or ``sandwich``).

    Attributes:
        shared: (S, S) covariance of the shared raw names.
        own: (n, K, K) covariance of each image's own raw names (rows/columns 0 at held positions).
    """

    shared: Tensor
    own: Tensor


def dense_covariances(F: Tensor, M: Tensor, held: Sequence[int]) -> tuple[Tensor, Tensor, float]:
    """``(F^-1, F^-1 M F^-1, condition)`` with the ``held`` positions left out (rows and columns 0 there)."""
    P = F.shape[0]
    held_set = set(held)
    keep = torch.tensor([i for i in range(P) if i not in held_set], dtype=torch.long)
    Ck, blind, cond = pseudo_inverse(F[keep[:, None], keep[None, :]])
    Sk = mark_blind(Ck @ M[keep[:, None], keep[None, :]] @ Ck, blind)
    Ck = mark_blind(Ck, blind)
    C_fisher, C_sandwich = torch.zeros_like(F), torch.zeros_like(F)
    C_fisher[keep[:, None], keep[None, :]] = Ck
    C_sandwich[keep[:, None], keep[None, :]] = Sk
    return C_fisher, C_sandwich, cond


def assemble(blocks: Tensor, S: int) -> Tensor:
    """The joint (P, P) matrix from per-image ``[shared, own]`` blocks (n, S + K, S + K)."""
    n, q = blocks.shape[0], blocks.shape[1]
    K = q - S
    out = torch.zeros(S + n * K, S + n * K, dtype=blocks.dtype)
    for i in range(n):
        idx = torch.cat([torch.arange(S), torch.arange(S + i * K, S + (i + 1) * K)])
        out[idx[:, None], idx[None, :]] += blocks[i]
    return out


def _dense(F_blocks: Tensor, M_blocks: Tensor, S: int, R: Tensor | None,
           held: Sequence[int]) -> tuple[JointCovariances, JointCovariances, float]:
    n, q = F_blocks.shape[0], F_blocks.shape[1]
    K = q - S
    F, M = assemble(F_blocks, S), assemble(M_blocks, S)
    if R is not None:  # the restraint: once, in the Fisher matrix and the sandwich's meat
        F[:S, :S] += R
        M[:S, :S] += R
    C_f, C_s, cond = dense_covariances(F, M, held)

    def split(C: Tensor) -> JointCovariances:
        own = torch.stack([C[S + i * K:S + (i + 1) * K, S + i * K:S + (i + 1) * K] for i in range(n)]) if n \
            else C.new_zeros(0, K, K)
        return JointCovariances(C[:S, :S].clone(), own.clone())

    return split(C_f), split(C_s), cond


def _blocked(F_blocks: Tensor, M_blocks: Tensor, S: int, R: Tensor | None,
             held: Sequence[int]) -> tuple[JointCovariances, JointCovariances, float]:
    """The Schur-complement path, image by image (:mod:`refine.many.schur`; :func:`refine.many.joint` runs the
    same steps with each image's elimination on the process that holds it)."""
    n, q = F_blocks.shape[0], F_blocks.shape[1]
    K = q - S
    held_own = {(h - S) // K: (h - S) % K for h in held}
    parts = [eliminate(F_blocks[i], M_blocks[i], S, held_own.get(i)) for i in range(n)]
    C_ss, blind_s, Q, cond = shared_covariance(torch.stack([e.schur for e in parts]) if n else F_blocks.new_zeros(0, S, S),
                                               torch.stack([e.meat for e in parts]) if n else F_blocks.new_zeros(0, S, S),
                                               R)
    own = [own_covariances(e, C_ss, Q, K) for e in parts]
    fisher_own = torch.stack([f for f, _ in own]) if n else F_blocks.new_zeros(0, K, K)
    sandwich_own = torch.stack([s for _, s in own]) if n else F_blocks.new_zeros(0, K, K)
    S_ss = C_ss @ Q @ C_ss
    return (JointCovariances(mark_blind(C_ss, blind_s), fisher_own),
            JointCovariances(mark_blind(0.5 * (S_ss + S_ss.T), blind_s), sandwich_own),
            max([cond] + [e.condition for e in parts]))


def shared_covariance(schur: Tensor, meat: Tensor, R: Tensor | None) -> tuple[Tensor, Tensor, Tensor, float]:
    """``(C_ss, blind, Q, condition)`` from the images' Schur contributions and projected meats (m, S, S), summed
    here (a joint run passes their exact sums over every process, m = 1), plus a restraint's curvature ``R`` once
    in each."""
    Sc, Q = schur.sum(0), meat.sum(0)
    if R is not None:
        Sc, Q = Sc + R, Q + R
    C_ss, blind, cond = pseudo_inverse(0.5 * (Sc + Sc.T))
    return C_ss, blind, Q, cond


def joint_covariances(F_blocks: Tensor, M_blocks: Tensor, S: int, R: Tensor | None = None,
                      held: Sequence[int] = (), blocked: bool | None = None
                      ) -> tuple[JointCovariances, JointCovariances, float]:
    """``(fisher, sandwich, condition)`` covariance blocks of a joint refinement (module docstring).

    Arguments:
        F_blocks, M_blocks: (n, S + K, S + K) each image's Fisher and score (meat) matrices over
            ``[shared, own]`` raw names.
        S: the number of shared raw names.
        R: (S, S) a restraint's curvature on the shared names, added once to both (or None).
        held: joint raw positions (``S + i K + k``) not refined: left out, their covariance 0.
        blocked: force the blocked (True) or dense (False) path; None: blocked above :data:`MAX_DENSE`.
    """
    n, q = F_blocks.shape[0], F_blocks.shape[1]
    P = S + n * (q - S)
    if blocked is None:
        blocked = P > MAX_DENSE
    return (_blocked if blocked else _dense)(F_blocks, M_blocks, S, R, held)
