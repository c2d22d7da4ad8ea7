"""The arrowhead information matrix of a joint refinement, one image at a time (:mod:`refine.many.joint`).

The joint Fisher matrix over ``[shared (S), image 0's own (K), image 1's own (K), ...]`` is an arrowhead::

        | A    B_1  ...  B_n |        A   = sum_i A_i + R   (A_i = F_i[s, s]; R a restraint's curvature)
    F = | B_1' D_1           |        B_i = F_i[s, own],  D_i = F_i[own, own]
        | ...       ...      |
        | B_n'           D_n |

Eliminating image ``i``'s own block needs only that image's ``(S + K)^2`` block, so it is done by the process
that holds the image (:func:`eliminate`): it hands on the image's **Schur contribution** ``A_i - B_i D_i^-1 B_i'``
(its information about the shared names with its own names profiled out; ``S x S``) and, for the sandwich, the
projected meat ``T_i M_i T_i'`` with ``T_i = [I, -B_i D_i^-1]``.  These ``S x S`` terms are summed exactly over
every process's images (:mod:`refine.many.exact_sum`), so every process holds the same bits for any number of
processes; nothing of size ``(S + n K)^2`` is ever built.  The shared covariance is the inverse
of the summed Schur complement; each image's own covariance comes back from its block on its own process
(:func:`own_covariances`; the formulas in :mod:`refine.many.esds`).

The **preconditioner** (:class:`ArrowheadPreconditioner`) whitens the same matrix by its block factorisation
``F = M' diag(Sc, D_1, ..., D_n) M`` with ``M = [[I, 0], [D_i^-1 B_i', I]]``: ``raw = raw0 + M^-1 diag(W_s, W_1,
..., W_n) z``, i.e. ``x_s = W_s z_s`` and ``x_i = W_i z_i - G_i x_s`` with ``G_i = D_i^-1 B_i'`` and ``W`` the
symmetric inverse square roots (:func:`refine.solver.precondition.preconditioner_from_fisher`, ``"full"``) of
``Sc`` and ``D_i``.  Then ``A' F A = I`` exactly: the Gauss-Newton Hessian at the start is the identity, as the
dense ``"full"`` whitening makes it, in memory ``n (K^2 + K S)``: a process holds its images' ``W_i`` and ``G_i``
(and its part of a raw vector, :mod:`refine.many.sharded`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refine.many.exact_sum import exact_sums
from refine.many.sharded import ShardedVector
from refine.quality.uncertainty import mark_blind, pseudo_inverse
from refine.solver.precondition import preconditioner_from_fisher

__all__ = ["Elimination", "eliminate", "own_covariances", "ArrowheadPreconditioner", "arrowhead_factors",
           "arrowhead_preconditioner"]


@dataclass(frozen=True)
class Elimination:
    """One image's own block eliminated (kept on the process that holds the image).

    Attributes:
        keep: (k,) the own positions that are refined (all but a held one).
        D_inv: (k, k) pseudo-inverse of the own block; ``blind``: (k,) own names without information.
        B: (S, k) coupling of the shared names to the kept own ones; ``M``: (S + k, S + k) the meat there.
        schur: (S, S) ``A_i - B D^-1 B'``; ``meat``: (S, S) ``T M T'``; ``condition``: of the own block.
    """

    keep: Tensor
    D_inv: Tensor
    blind: Tensor
    B: Tensor
    M: Tensor
    schur: Tensor
    meat: Tensor
    condition: float

    def T(self) -> Tensor:
        """(S, S + k) ``[I, -B D^-1]``."""
        S = self.B.shape[0]
        return torch.cat([torch.eye(S, dtype=self.B.dtype), -self.B @ self.D_inv], 1)


def eliminate(F: Tensor, M: Tensor, S: int, held: int | None = None) -> Elimination:
    """Eliminate one image's own names from its ``[shared, own]`` Fisher block ``F`` and meat ``M`` (both
    ``(S + K, S + K)``); ``held``: an own position (0..K-1) that is not refined (left out)."""
    K = F.shape[0] - S
    keep = torch.tensor([k for k in range(K) if k != held], dtype=torch.long)
    D = F[S:, S:][keep[:, None], keep[None, :]]
    if keep.numel():
        D_inv, blind, cond = pseudo_inverse(D)
    else:
        D_inv, blind, cond = D.new_zeros(0, 0), torch.zeros(0, dtype=torch.bool), 1.0
    B = F[:S, S:][:, keep]
    idx = torch.cat([torch.arange(S), S + keep])
    Mk = M[idx[:, None], idx[None, :]]
    schur = F[:S, :S] - B @ D_inv @ B.T
    T = torch.cat([torch.eye(S, dtype=F.dtype), -B @ D_inv], 1)
    return Elimination(keep, D_inv, blind, B, Mk, schur, T @ Mk @ T.T, cond)


def own_covariances(e: Elimination, C_ss: Tensor, Q: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """(K, K) Fisher and sandwich covariances of one image's own names (0 at a held position, infinite
    variance at a blind one) from its :class:`Elimination`, the shared Fisher covariance ``C_ss`` and the summed
    projected meat ``Q`` (the formulas in :mod:`refine.many.esds`)."""
    dt, S, k = C_ss.dtype, C_ss.shape[0], e.keep.numel()
    U = -e.D_inv @ e.B.T @ C_ss
    Cf = e.D_inv - U @ e.B @ e.D_inv
    E = torch.cat([torch.zeros(k, S, dtype=dt), e.D_inv], 1)
    UT = U @ e.T()
    Cs = U @ Q @ U.T + E @ e.M @ E.T + UT @ e.M @ E.T + E @ e.M @ UT.T
    fisher, sandwich = torch.zeros(K, K, dtype=dt), torch.zeros(K, K, dtype=dt)
    sel = (e.keep[:, None], e.keep[None, :])
    fisher[sel] = mark_blind(0.5 * (Cf + Cf.T), e.blind)
    sandwich[sel] = mark_blind(0.5 * (Cs + Cs.T), e.blind)
    return fisher, sandwich


# -- preconditioning ----------------------------------------------------------------------------------------
def arrowhead_factors(F: Tensor, S: int, held: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One image's share of the preconditioner from its raw-unit Fisher block ``F`` (S + K, S + K):
    ``(W_i (K, K), G_i (K, S), Schur contribution (S, S))``; a held own position is one raw unit, uncoupled."""
    F = F.clone()
    if held is not None:
        F[S + held, :], F[:, S + held] = 0.0, 0.0
        F[S + held, S + held] = 1.0
    K = F.shape[0] - S
    D, B = F[S:, S:], F[:S, S:]
    W = preconditioner_from_fisher("full", D, torch.zeros(K, dtype=F.dtype)).A
    G = W @ (W.T @ B.T)  # D^-1 B' = W W' B' (W' D W = I); matrix products only: the same bits in any process
    return W, G, F[:S, :S] - B @ G


@dataclass(frozen=True)
class ArrowheadPreconditioner:
    """``raw = raw0 + A z`` with the arrowhead ``A`` of the module docstring (never built densely).

    Attributes:
        raw0: (S + n K,) raw start; ``Ws``: (C, C) whitening of the shared Schur complement of the first ``C``
            shared names; W: (n, K, K) whitening of each own block; ``G``: (n, K, C) ``D_i^-1 B_i'``.
        tail: None (``C = S``), or (S - C,) the whitening of the last ``S - C`` shared names by their diagonal
            alone, uncoupled from the others and from the own blocks (the many amplitudes of
            :mod:`refine.many.sparse_amplitudes`: ``x_t = tail z_t``).
    """

    raw0: Tensor
    Ws: Tensor
    W: Tensor
    G: Tensor
    tail: Tensor | None = None

    @property
    def n_tail(self) -> int:
        return 0 if self.tail is None else int(self.tail.numel())

    def to_raw(self, z: Tensor) -> Tensor:
        """``raw0 + A z``; on a vector split over processes (:mod:`refine.many.sharded`; ``W`` and ``G`` then of
        this process's images) its gradient sums every process's coupling ``G_i' g_i`` exactly
        (:class:`_SplitToRaw`)."""
        if isinstance(self.raw0, ShardedVector):
            return _SplitToRaw.apply(z, self)
        return self.raw0 + self._step(z)

    def _step(self, z: Tensor) -> Tensor:
        """``A z``; each image's part by :func:`_products` (the same bits for any split of the images)."""
        C, (n, K) = self.Ws.shape[0], self.W.shape[:2]
        S = C + self.n_tail
        xs = self.Ws @ z[:C]
        xo = _products(self.W, z[S:].reshape(n, K)) - _products(self.G, xs.expand(n, C))
        parts = [xs] + ([self.tail.to(z.dtype) * z[C:S]] if self.n_tail else []) + [xo.reshape(-1)]
        return torch.cat(parts)

    def z0(self) -> Tensor:
        return torch.zeros_like(self.raw0)

    def to_dict(self) -> dict:
        tail = {} if self.tail is None else {"tail": self.tail}
        return {"kind": "arrowhead", "raw0": self.raw0, "Ws": self.Ws, "W": self.W, "G": self.G, **tail}

    def dense(self) -> Tensor:
        """(P, P) ``A`` itself (tests and small problems only)."""
        eye = torch.eye(self.raw0.numel(), dtype=self.raw0.dtype)
        zero = ArrowheadPreconditioner(torch.zeros_like(self.raw0), self.Ws, self.W, self.G, self.tail)
        return torch.stack([zero.to_raw(e) for e in eye], 1)


def _products(M: Tensor, v: Tensor) -> Tensor:
    """(n, a): ``M[i] @ v[i]`` for each image ``i`` of ``M`` (n, a, b) and ``v`` (n, b), by elementwise products
    added in column order: each image's numbers are the same bits however many images there are and wherever
    they sit in memory (a batched or BLAS product may round by its blocking and alignment)."""
    n, a, b = M.shape
    acc = M.new_zeros(n, a) if b == 0 else M[:, :, 0] * v[:, 0:1]
    for col in range(1, b):
        acc = acc + M[:, :, col] * v[:, col:col + 1]
    return acc


class _SplitToRaw(torch.autograd.Function):
    """``z -> raw0 + A z`` on this process's part of a split vector; the backward pass is ``A' g`` with the
    shared rows' sum over images ``sum_i G_i' g_i`` taken exactly over every process's images."""

    @staticmethod
    def forward(ctx, z: Tensor, pre: "ArrowheadPreconditioner") -> Tensor:  # type: ignore[override]
        ctx.pre = pre
        with torch.no_grad():
            return pre.raw0 + pre._step(z.detach())

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        pre = ctx.pre
        C, (n, K) = pre.Ws.shape[0], pre.W.shape[:2]
        S = C + pre.n_tail
        g = g.as_subclass(Tensor)
        g_own = g[S:].reshape(n, K)
        coupling = exact_sums(_products(pre.G.transpose(1, 2), g_own), type(pre.raw0).layout.reduce_sum)
        g_shared = pre.Ws.T @ (g[:C] - coupling.to(g.dtype))
        tail = [pre.tail.to(g.dtype) * g[C:S]] if pre.n_tail else []
        g_z = torch.cat([g_shared, *tail, _products(pre.W.transpose(1, 2), g_own).reshape(-1)])
        return g_z.as_subclass(type(pre.raw0)), None


def arrowhead_preconditioner(raw0: Tensor, factors: tuple[Tensor, Tensor, Tensor],
                             extra: Tensor | None = None) -> ArrowheadPreconditioner:
    """The preconditioner from the images' :func:`arrowhead_factors` stacked (``(n, K, K), (n, K, S)``, this
    process's images for a split raw vector) and their Schur contributions ``(m, S, S)`` (summed here; a joint run
    passes their exact sum over every process, ``m = 1``); ``extra``: a restraint's (S, S) curvature."""
    W, G, schur = factors
    Sc = schur.sum(0) if schur.shape[0] else torch.zeros(G.shape[2], G.shape[2], dtype=raw0.dtype)
    if extra is not None:
        Sc = Sc + extra.to(Sc.dtype)
    S = Sc.shape[0]
    Ws = preconditioner_from_fisher("full", 0.5 * (Sc + Sc.T), torch.zeros(S, dtype=raw0.dtype)).A
    return ArrowheadPreconditioner(raw0.detach().clone(), Ws, W, G)
